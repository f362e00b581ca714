"""Random-weight models of the architectures agents run on, written by llama.cpp's own ``test-llama-archs``.

llama.cpp writes a real model of each architecture it supports (real kernels, real KV and recurrent buffers, real
state layouts; random weights and a dummy tokenizer of 5-byte chunks). Its files carry a 256-token trained context
and no chat template: this rewrites each header with the ``gguf`` package so agent-sized sessions fit, and gives
each the family's real chat template from llama.cpp's ``models/templates``.

Beside them, files made with the ``gguf`` package: a reranker (``reranker.gguf``: llama.cpp's qwen3 model made a
Qwen3-Reranker: rank pooling, a two-label "yes"/"no" classifier head, the rerank prompt), a BERT cross-encoder
(``reranker-bert.gguf``, written whole: the bge-reranker and jina kind) and two LoRA
adapters for the llama fixture (``llama-lora-a.gguf``, ``llama-lora-b.gguf``: general.type "adapter", random
low-rank deltas on the attention projections, as llama.cpp's convert_lora_to_gguf.py writes them).

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
from typing import Any

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
# written with the gguf package (below)
EXTRAS = ("reranker", "reranker-bert", "llama-lora-a", "llama-lora-b", "qwen3vl-deepstack")


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


# Qwen3-Reranker's prompt, as llama.cpp's converter stores it (``tokenizer.chat_template.rerank``)
RERANK_PROMPT = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
                 "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
                 "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK
LORA_RANK = 8
LORA_TARGETS = ("attn_q", "attn_v")  # the projections the adapters change (as most LoRA fine-tunes do)


def _copy(reader: Any, target: Path, *, metadata: dict[str, Any], tensors: dict[str, Any] | None = None,
          arch: str | None = None) -> None:
    """Write ``reader``'s file again to ``target`` with ``metadata`` changed or added (name: MetadataDetails) and
    ``tensors`` replaced (name: a float32 array; the others copied as they are)."""
    import gguf

    arch = arch or str(reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    temp = target.with_name(f".{target.name}.tmp")
    writer = gguf.GGUFWriter(temp, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or field.name in metadata:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY and not field.data:
            continue  # llama.cpp's saver writes empty arrays; the gguf package refuses them
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for key, details in metadata.items():
        writer.add_key_value(key, details.value, details.type, sub_type=details.sub_type)
    for tensor in reader.tensors:
        data = (tensors or {}).get(tensor.name, tensor.data)
        writer.add_tensor(tensor.name, data, raw_dtype=None if tensor.name in (tensors or {}) else tensor.tensor_type)
    _write_whole(writer, temp, target)


def _write_whole(writer: Any, temp: Path, target: Path) -> None:
    """A GGUF writer's file written to ``temp`` and moved onto ``target``: whole or not at all."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(temp, target)


def _produce(tool: Path, arch: str, scratch: Path, variant: str = "dense") -> Path:
    """``test-llama-archs``' model of ``arch`` written into ``scratch``."""
    result = subprocess.run([str(tool), "-a", arch, "-s", str(SEED), "-o", str(scratch)], capture_output=True,
                            text=True)
    produced = scratch / f"{arch}-{variant}.gguf"
    if result.returncode != 0 or not produced.exists():
        raise SystemExit(f"test-llama-archs wrote no {arch} ({variant}) model (exit {result.returncode}): "
                         f"{result.stderr[-2000:]}")
    return produced


def write_reranker(tool: Path, out: Path) -> Path:
    """``reranker.gguf``: test-llama-archs' qwen3 model with Qwen3-Reranker's head (rank pooling reads the last
    token through a [n_embd, 2] classifier, softmax over "yes"/"no": the score is P(yes)) and its rerank prompt."""
    import gguf
    import numpy as np
    from gguf.scripts.gguf_new_metadata import MetadataDetails

    with tempfile.TemporaryDirectory() as scratch:
        reader = gguf.GGUFReader(_produce(tool, "qwen3", Path(scratch)), "r")
        n_embd = int(reader.get_field("qwen3.embedding_length").contents())
        head = np.random.default_rng(SEED).normal(0, 4.0, size=(2, n_embd)).astype(np.float32)
        strings = gguf.GGUFValueType.STRING
        metadata = {
            "qwen3.pooling_type": MetadataDetails(gguf.GGUFValueType.UINT32, RANK_POOLING),
            "qwen3.classifier.output_labels": MetadataDetails(gguf.GGUFValueType.ARRAY, ["yes", "no"],
                                                              sub_type=strings),
            "qwen3.context_length": MetadataDetails(gguf.GGUFValueType.UINT32, 8192),
            "tokenizer.chat_template.rerank": MetadataDetails(strings, RERANK_PROMPT),
            "general.name": MetadataDetails(strings, "localai test reranker (random weights)"),
        }
        target = out / "reranker.gguf"
        _copy(reader, target, metadata=metadata, tensors={"cls.output.weight": head})
    return target


def write_deepstack(tool: Path, out: Path) -> Path:
    """``qwen3vl-deepstack.gguf``: test-llama-archs' Qwen3-VL text model with one deepstack layer (its first layer
    adds the second half of each image embedding: an embedding row is twice the model's width, as Qwen3-VL's)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails

    with tempfile.TemporaryDirectory() as scratch:
        target = out / "qwen3vl-deepstack.gguf"
        _copy(gguf.GGUFReader(_produce(tool, "qwen3vl", Path(scratch)), "r"), target, metadata={
            "qwen3vl.n_deepstack_layers": MetadataDetails(gguf.GGUFValueType.UINT32, 1)})
    return target


def write_bert_reranker(out: Path) -> Path:
    """``reranker-bert.gguf``: a BERT cross-encoder like bge-reranker and jina (non-causal, classifier head read at
    the first token, rank pooling, one label), random weights and a small WordPiece vocabulary, written whole with
    the ``gguf`` package (``test-llama-archs`` writes no BERT model). Its pairs take llama-server's other form:
    ``[CLS] query [SEP] [SEP] document [SEP]``."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(SEED)
    n_embd, layers, heads, n_ff, context = 64, 2, 4, 128, 512
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + ["\u2581" + c for c in "abcdefghijklmnopqrstuvwxyz?.,"]
    words += list("abcdefghijklmnopqrstuvwxyz") + ["\u2581" + word for word in (
        "the", "cat", "sat", "on", "mat", "bread", "oven", "bake", "how", "do", "in", "an", "quark", "river", "code")]
    target = out / "reranker-bert.gguf"
    temp = target.with_name(f".{target.name}.tmp")
    writer = gguf.GGUFWriter(temp, arch="bert")
    writer.add_name("localai test BERT reranker (random weights)")
    writer.add_context_length(context)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_classifier_output_labels(["LABEL_0"])
    writer.add_tokenizer_model("bert")
    writer.add_token_list(words)
    writer.add_token_types([gguf.TokenType.CONTROL] * 5 + [gguf.TokenType.NORMAL] * (len(words) - 5))
    writer.add_token_type_count(2)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(3)
    writer.add_sep_token_id(3)
    writer.add_unk_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)

    def normal(name: str, *shape: int, scale: float = 0.2) -> None:
        writer.add_tensor(name, rng.normal(0, scale, size=shape).astype(np.float32))

    def constant(name: str, size: int, value: float) -> None:
        writer.add_tensor(name, np.full(size, value, dtype=np.float32))

    normal("token_embd.weight", len(words), n_embd)
    normal("token_types.weight", 2, n_embd)
    normal("position_embd.weight", context, n_embd)
    constant("token_embd_norm.weight", n_embd, 1.0)
    constant("token_embd_norm.bias", n_embd, 0.0)
    for layer in range(layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            normal(f"blk.{layer}.{name}.weight", n_embd, n_embd)
            constant(f"blk.{layer}.{name}.bias", n_embd, 0.0)
        for name in ("attn_output_norm", "layer_output_norm"):
            constant(f"blk.{layer}.{name}.weight", n_embd, 1.0)
            constant(f"blk.{layer}.{name}.bias", n_embd, 0.0)
        normal(f"blk.{layer}.ffn_up.weight", n_ff, n_embd)
        constant(f"blk.{layer}.ffn_up.bias", n_ff, 0.0)
        normal(f"blk.{layer}.ffn_down.weight", n_embd, n_ff)
        constant(f"blk.{layer}.ffn_down.bias", n_embd, 0.0)
    normal("cls.weight", n_embd, n_embd)
    normal("cls.bias", n_embd, scale=0.1)
    normal("cls.output.weight", 1, n_embd, scale=2.0)
    constant("cls.output.bias", 1, 0.5)
    _write_whole(writer, temp, target)
    return target


def write_lora(target: Path, arch: str, tensors: dict[str, Any], name: str | None = None) -> Path:
    """A LoRA adapter GGUF for an ``arch`` model, as llama.cpp's convert_lora_to_gguf.py writes one: general.type
    "adapter", adapter.type "lora", alpha 16, and ``tensors`` (``<tensor>.lora_a`` [rank, in] and ``.lora_b``
    [out, rank], numpy's order); written whole or not at all."""
    import gguf

    temp = target.with_name(f".{target.name}.tmp")
    writer = gguf.GGUFWriter(temp, arch=arch)
    writer.add_string(gguf.Keys.General.TYPE, gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 16.0)
    if name is not None:
        writer.add_name(name)
    for tensor_name, values in tensors.items():
        writer.add_tensor(tensor_name, values)
    _write_whole(writer, temp, target)
    return target


def write_loras(model: Path, out: Path) -> list[Path]:
    """Two LoRA adapters for ``model`` (the llama fixture), different seeds: A [rank, in] and B [out, rank] for each
    attention q and v projection, alpha 16 (a scale of alpha/rank = 2 at adapter scale 1)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(model, "r")
    arch = str(reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    written = []
    for suffix, seed in (("a", SEED + 1), ("b", SEED + 2)):
        rng = np.random.default_rng(seed)
        tensors: dict[str, Any] = {}
        for tensor in reader.tensors:
            if not tensor.name.endswith(tuple(f".{name}.weight" for name in LORA_TARGETS)):
                continue
            rows, cols = tensor.data.shape  # numpy order: [out, in]
            tensors[f"{tensor.name}.lora_a"] = rng.normal(0, 0.3, size=(LORA_RANK, cols)).astype(np.float32)
            tensors[f"{tensor.name}.lora_b"] = rng.normal(0, 0.3, size=(rows, LORA_RANK)).astype(np.float32)
        written.append(write_lora(out / f"{model.stem}-lora-{suffix}.gguf", arch, tensors,
                                  name=f"localai test LoRA {suffix} (random weights)"))
    return written


def write(tool: Path, templates: Path, out: Path, names: list[str] | None = None) -> list[Path]:
    """Run ``test-llama-archs -a ARCH -o DIR`` for each fixture and rewrite its header into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fixture in [BY_NAME[name] for name in names] if names else FIXTURES:
        with tempfile.TemporaryDirectory() as scratch:
            produced = _produce(tool, fixture.arch, Path(scratch), fixture.variant)
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
    written = write(args.tool, args.templates, args.out, args.names or None)
    if not args.names:
        extra = [write_reranker(args.tool, args.out), write_bert_reranker(args.out),
                 *write_loras(next(p for p in written if p.stem == "llama"), args.out),
                 write_deepstack(args.tool, args.out)]
        for path in extra:
            kind = ("a LoRA for llama" if "lora" in path.stem else "Qwen3-VL with deepstack" if "deepstack" in path.stem
                    else "a reranker")
            print(f"  {path.name:22} {path.stat().st_size / 1e6:5.1f} MB  {kind}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
