"""A cut-down copy of a GGUF for a machine it cannot be sent to whole (the lent GPU machine takes 64 MiB a call):
the first N layers, and the token embeddings requantized to Q4_0. Its answers are not the model's, but it runs
every path of the GPU tier (offload, placement, state round trips, CPU agreement) on the same architecture.

    python -m tests.engines.gpu.cutdown SRC.gguf DST.gguf --layers 12
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize


def cut(source: Path, target: Path, layers: int) -> None:
    reader = GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else field.contents()
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, kind)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        shape = [int(n) for n in reversed(tensor.shape)]  # numpy order
        data, kind = tensor.data, GGMLQuantizationType(tensor.tensor_type)
        if tensor.name == "token_embd.weight" and kind == GGMLQuantizationType.Q8_0:
            data, kind = quantize(dequantize(data, kind).reshape(shape), GGMLQuantizationType.Q4_0), \
                GGMLQuantizationType.Q4_0
        writer.add_tensor(tensor.name, np.asarray(data), raw_shape=data.shape if kind != tensor.tensor_type
                          else tensor.data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    cut(args.source, args.target, args.layers)
