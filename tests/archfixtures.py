"""Random-weight models of the architectures agents run on, written by llama.cpp's own ``test-llama-archs``.

llama.cpp writes a real model of each architecture it supports (real kernels, real KV and recurrent buffers, real
state layouts; random weights and a dummy tokenizer of 5-byte chunks). Its files carry a 256-token trained context
and no chat template: this rewrites each header with the ``gguf`` package so agent-sized sessions fit, and gives
each the family's real chat template from llama.cpp's ``models/templates``.

``python -m tests.archfixtures --tool BIN --templates DIR --out DIR`` writes them (``make fixtures`` does);
the tests find them in ``fixtures_dir()``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONTEXT = 32768  # agent-sized: a 20-30k-token coding session fits
SEED = 42  # the weights are the same on every machine and every run


@dataclass(frozen=True)
class Fixture:
    name: str  # the file's stem and the tests' id
    arch: str  # llama.cpp's architecture name
    variant: str  # "dense" or "moe": which of test-llama-archs' two files
    template: str  # llama.cpp's models/templates/<template>
    kind: str  # what the prompt cache meets: dense, recurrent (hybrid), or swa (sliding window)
    family: str  # the models it stands for


FIXTURES = [
    Fixture("llama", "llama", "dense", "meta-llama-Llama-3.1-8B-Instruct.jinja", "dense", "the dense control"),
    Fixture("qwen3moe", "qwen3moe", "moe", "Qwen3-Coder.jinja", "dense", "Qwen3-Coder-30B-A3B (MoE)"),
    Fixture("deepseek2", "deepseek2", "moe", "GLM-4.7-Flash.jinja", "dense",
            "GLM-4.7-Flash (latent attention, MoE)"),
    Fixture("glm4moe", "glm4moe", "moe", "GLM-4.6.jinja", "dense", "GLM-4.5/4.6 (MoE)"),
    Fixture("gpt-oss", "gpt-oss", "moe", "openai-gpt-oss-120b.jinja", "swa",
            "gpt-oss (sliding window with sinks, MoE)"),
    Fixture("qwen35", "qwen35", "dense", "Qwen3.5-4B.jinja", "recurrent", "Qwen3.5/3.6 (Gated DeltaNet hybrid)"),
    Fixture("qwen35moe", "qwen35moe", "moe", "Qwen3.5-4B.jinja", "recurrent", "Qwen3.5/3.6 MoE (hybrid)"),
    Fixture("qwen3next", "qwen3next", "moe", "Qwen-Qwen3-0.6B.jinja", "recurrent", "Qwen3-Next (hybrid MoE)"),
    Fixture("nemotron_h", "nemotron_h", "dense", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "recurrent",
            "NVIDIA Nemotron 3 Nano (Mamba-2 hybrid)"),
    Fixture("granitehybrid", "granitehybrid", "dense", "ibm-granite-granite-4.0.jinja", "recurrent",
            "IBM Granite 4 (Mamba-2 hybrid)"),
    Fixture("lfm2", "lfm2", "dense", "LFM2.5-Instruct.jinja", "recurrent", "LFM2 (short-conv hybrid)"),
]
BY_NAME = {fixture.name: fixture for fixture in FIXTURES}


def fixtures_dir() -> Path:
    """Where ``make fixtures`` writes the files (``LOCALAI_FIXTURES`` moves it)."""
    root = Path(__file__).resolve().parent.parent
    return Path(os.environ.get("LOCALAI_FIXTURES") or root / ".bench" / "fixtures")


def fixture_path(name: str) -> Path:
    return fixtures_dir() / f"{name}.gguf"


def rewrite(source: Path, target: Path, template: str, context: int = CONTEXT) -> None:
    """A copy of ``source`` with a trained context of ``context`` tokens and ``template`` as its chat template;
    tensors unchanged. The ``gguf`` package's own metadata copier does the work."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(source, "r")
    arch = str(reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    metadata = {
        gguf.Keys.LLM.CONTEXT_LENGTH.format(arch=arch): MetadataDetails(gguf.GGUFValueType.UINT32, context),
        gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(gguf.GGUFValueType.STRING, template),
    }
    temp = target.with_name(f".{target.name}.tmp")
    writer = gguf.GGUFWriter(temp, arch=arch, endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    import logging

    logging.getLogger("gguf-new-metadata").setLevel(logging.WARNING)
    empty = [field.name for field in reader.fields.values()  # llama.cpp's saver writes some; gguf refuses them
             if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and not field.data]
    copy_with_new_metadata(reader, writer, metadata, empty)
    os.replace(temp, target)


def write(tool: Path, templates: Path, out: Path, names: list[str] | None = None) -> list[Path]:
    """Run ``test-llama-archs -a ARCH -o DIR`` for each fixture and rewrite its header into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fixture in [BY_NAME[name] for name in names] if names else FIXTURES:
        with tempfile.TemporaryDirectory() as scratch:
            result = subprocess.run([str(tool), "-a", fixture.arch, "-s", str(SEED), "-o", scratch],
                                    capture_output=True, text=True)
            produced = Path(scratch) / f"{fixture.arch}-{fixture.variant}.gguf"
            if result.returncode != 0 or not produced.exists():
                raise SystemExit(f"test-llama-archs wrote no {fixture.arch} ({fixture.variant}) model "
                                 f"(exit {result.returncode}): {result.stderr[-2000:]}")
            template = (templates / fixture.template).read_text()
            target = out / f"{fixture.name}.gguf"
            rewrite(produced, target, template)
        written.append(target)
        print(f"  {target.name:22} {target.stat().st_size / 1e6:5.1f} MB  {fixture.family}", flush=True)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", type=Path, required=True, help="the test-llama-archs binary")
    parser.add_argument("--templates", type=Path, required=True, help="llama.cpp's models/templates folder")
    parser.add_argument("--out", type=Path, default=fixtures_dir())
    parser.add_argument("names", nargs="*", help="fixtures to write (default: all)")
    args = parser.parse_args(argv)
    write(args.tool, args.templates, args.out, args.names or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
