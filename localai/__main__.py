from localai.cli import main

main()
