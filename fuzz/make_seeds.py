#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets into fuzz/corpus/<target>/.

Seeds are small hand-made files: valid ones covering every feature of the format, and
invalid ones breaking each rule once, so that the fuzzer starts from every branch of the
validation. The output is deterministic; run it again after changing the lists below.

    python3 fuzz/make_seeds.py
"""

import json
import os
import shutil
import struct

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")

# Kept in step with FILE_SEPARATOR in fuzz/src/lib.rs.
FILE_SEPARATOR = b"\xff\xfe<next file>\xfe\xff"

BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64,
}


def raw(header: bytes, data: bytes = b"", length=None) -> bytes:
    """A file of `header` (the JSON as bytes) and `data`, with the given or true length."""
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def text(header: str, data_len: int = 0, **kw) -> bytes:
    return raw(header.encode(), bytes(i * 7 % 251 for i in range(data_len)), **kw)


def model(tensors, metadata=None, pad_to=1, extra_data=0) -> bytes:
    """A valid file of (name, dtype, shape) tensors laid out in order, unless `extra_data`."""
    header, offset = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        numel = 1
        for d in shape:
            numel *= d
        size = numel * BITS[dtype] // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False)
    while (8 + len(encoded)) % pad_to:
        encoded += " "
    return text(encoded, offset + extra_data)


def entry(dtype, shape, begin, end) -> str:
    return json.dumps({"dtype": dtype, "shape": shape, "data_offsets": [begin, end]})


VALID = {
    "empty-header": text("{}"),
    "metadata-only": model([], metadata={"format": "pt"}),
    "null-metadata": text('{"__metadata__":null}'),
    "one-f32": model([("w", "F32", [2, 2])]),
    "scalar-and-empty": model([("s", "F64", []), ("e", "F16", [0, 4]), ("b", "BOOL", [3])]),
    "aligned-header": model([("embed", "BF16", [4, 3]), ("norm", "F32", [3]), ("ids", "I64", [2])], pad_to=8),
    "misaligned-header": model([("w", "F32", [3]), ("b", "U8", [1]), ("v", "F64", [1])]),
    "packed": model([("a", "F4", [2, 3]), ("b", "F6_E2M3", [4]), ("c", "F6_E3M2", [8]), ("d", "F8_E8M0", [2])]),
    "every-dtype": model([(f"t_{d.lower()}", d, [8]) for d in BITS], metadata={"k": "v"}),
    "keys-out-of-order": text(
        "{" + f'"b":{entry("U8", [2], 2, 4)},"a":{entry("U8", [2], 0, 2)},"__metadata__":{{}}' + "}", 4
    ),
    "unicode-names": model([("π.weight", "F16", [1]), ("名前", "U8", [2]), ('quo"te\\', "I8", [1])]),
    "escaped-name": text('{"\\u0041\\n":' + entry("U8", [1], 0, 1) + "}", 1),
    "zero-size-same-offset": text(
        "{" + f'"a":{entry("F32", [0], 0, 0)},"b":{entry("U8", [0], 0, 0)},"c":{entry("U8", [1], 0, 1)}' + "}", 1
    ),
    "whitespace-padding": text("  {}  \n\t"),
    "deep-unknown-field": text('{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":' + "[" * 300 + "]" * 300 + "}}"),
    "unknown-field": text('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":[1,{"x":null}]}}', 1),
    # A 640-byte header: its length opens with 80 02, as a pickle does.
    "pickle-like-length": text("{" + " " * 638 + "}"),
}

# Files of other formats, named in the error instead of "header length ... exceeds the limit".
FOREIGN = {
    "torch-zip": b"PK\x03\x04\x00\x00\x08\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"
                 b"\x00\x00\x00\x00\x00\x00\x10\x00\x12\x00archive/data.pklFB\x0e\x00ZZZZ",
    "torch-pickle": b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9\x03.\x80\x02}q\x00(X\x10\x00\x00\x00",
    "json-index": b'{\n  "metadata": {\n    "total_size": 16\n  },\n  "weight_map": {\n    "w": "model.safetensors"\n  }\n}\n',
    "lfs-pointer": b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 548105171\n",
    "text": b"These are not the weights you are looking for.\n",
}

INVALID = {
    "empty-file": b"",
    "seven-bytes": b"\x02\x00\x00\x00\x00\x00\x00",
    "length-only": struct.pack("<Q", 0),
    "header-past-end": raw(b"{}", length=3),
    "header-len-max": raw(b"{}", length=0xFFFF_FFFF_FFFF_FFFF),
    "header-over-limit": raw(b"{}", length=100_000_001),
    "not-utf8": raw(b'{"\xff":1}'),
    "nul-in-header": raw(b'{"a\x00":' + entry("U8", [1], 0, 1).encode() + b"}", b"\x01"),
    "not-json": text("{not json"),
    "empty-json": text(""),
    "json-array": text("[]"),
    "json-null": text("null"),
    "deep-nesting": text('{"a":' + "[" * 200 + "]" * 200 + "}"),
    "unknown-dtype": text('{"a":' + entry("F128", [1], 0, 16) + "}", 16),
    "lowercase-dtype": text('{"a":' + entry("f32", [1], 0, 4) + "}", 4),
    "dtype-not-string": text('{"a":{"dtype":7,"shape":[1],"data_offsets":[0,1]}}', 1),
    "missing-offsets": text('{"a":{"dtype":"U8","shape":[1]}}', 1),
    "three-offsets": text('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}}', 1),
    "negative-shape": text('{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}', 1),
    "float-shape": text('{"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}', 1),
    "huge-number": text('{"a":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,1]}}', 1),
    "shape-overflow": text('{"a":' + entry("F32", [4294967296, 4294967296], 0, 4) + "}", 4),
    "bits-overflow": text('{"a":' + entry("F64", [4611686018427387904], 0, 8) + "}", 8),
    "huge-shape-tiny-file": text('{"a":' + entry("U8", [1 << 40], 0, 1 << 40) + "}", 4),
    "partial-byte": text('{"a":' + entry("F4", [3], 0, 2) + "}", 2),
    "length-mismatch": text('{"a":' + entry("F32", [2, 2], 0, 12) + "}", 12),
    "reversed-offsets": text('{"a":' + entry("U8", [0], 4, 0) + "}", 4),
    "gap": text("{" + f'"a":{entry("U8", [2], 0, 2)},"b":{entry("U8", [2], 3, 5)}' + "}", 5),
    "gap-at-start": text('{"a":' + entry("U8", [2], 1, 3) + "}", 3),
    "overlap": text("{" + f'"a":{entry("U8", [4], 0, 4)},"b":{entry("U8", [2], 2, 4)}' + "}", 4),
    "same-range-twice": text("{" + f'"a":{entry("U8", [4], 0, 4)},"b":{entry("U8", [4], 0, 4)}' + "}", 4),
    "out-of-bounds": text('{"a":' + entry("U8", [8], 0, 8) + "}", 4),
    "offsets-u64-max": text('{"a":' + entry("U8", [0], 2**64 - 1, 2**64 - 1) + "}", 4),
    "trailing-bytes": model([("a", "U8", [2])], extra_data=3),
    "truncated-data": model([("a", "F32", [4])])[:-5],
    "truncated-header": model([("a", "F32", [4])])[:20],
    "duplicate-name": text("{" + f'"a":{entry("U8", [1], 0, 1)},"a":{entry("U8", [1], 1, 2)}' + "}", 2),
    "duplicate-metadata": text('{"__metadata__":{},"__metadata__":{}}'),
    "metadata-not-string": text('{"__metadata__":{"a":1}}'),
    "metadata-nested": text('{"__metadata__":{"a":{"b":"c"}}}'),
    "metadata-as-tensor": text('{"__metadata__":' + entry("U8", [1], 0, 1) + "}", 1),
}


def multi(*files: bytes) -> bytes:
    return FILE_SEPARATOR.join(files)


def place_seeds():
    a = model([("a.w", "F32", [2]), ("a.b", "U8", [3])])
    b = model([("b.w", "BF16", [2, 2])], pad_to=8)
    c = model([("c.w", "F64", [1]), ("c.e", "I32", [0])])
    return {
        "one-file": a,
        "two-files": multi(a, b),
        "three-files": multi(a, b, c),
        "empty-files": multi(text("{}"), model([], metadata={"x": "y"})),
        "duplicate-across-files": multi(a, b, model([("a.b", "U8", [3])])),
        "duplicate-in-last-of-many": multi(a, b, c, text("{}"), model([("c.e", "I32", [0])])),
        "one-invalid": multi(a, INVALID["overlap"]),
        "misaligned": multi(VALID["misaligned-header"], VALID["packed"]),
    }


def read_blocks_seeds():
    def params(file_len, align, block):
        # Decoded by check_read_blocks: align = 1 + w1 % 65536, block = align * (1 + w2 % 65536).
        return struct.pack("<QQQ", file_len, align - 1, block // align - 1)

    return {
        "empty-file": params(0, 4096, 4096),
        "tiny": params(10, 4096, 8 << 20),
        "exact-multiple": params(16384, 4096, 8192),
        "partial-last": params(10_000, 4096, 8192),
        "odd-align": params(1_000_003, 3, 999),
        "align-one": params(17, 1, 1),
        "large-file": params(3 << 30, 4096, 8 << 20),
        "short-input": b"\x01",
    }


def write(target: str, seeds: dict):
    directory = os.path.join(CORPUS, target)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    for name, data in seeds.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)


def main():
    files = {**{f"valid-{k}": v for k, v in VALID.items()}, **{f"invalid-{k}": v for k, v in INVALID.items()},
             **{f"invalid-foreign-{k}": v for k, v in FOREIGN.items()}}
    for target in ("parse", "load", "differential"):
        write(target, files)
    write("place", place_seeds())
    write("read_blocks", read_blocks_seeds())


if __name__ == "__main__":
    main()
