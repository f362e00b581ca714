"""The abuse runs of `make stress`: fuzzing, kill -9 chaos, load, a full disk and the security checks, against real
daemons on the real model. Each prints its figures and its findings; the run fails when any check finds something.
`python -m tests.api.stress --help` lists them."""
