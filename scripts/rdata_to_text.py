#!/usr/bin/env python3
"""Convert the novels in an R lazy-load database (janeaustenr's data/Rdata.{rdx,rdb}) to text files.

R stores package data as a lazy-load DB: the .rdx index is a gzip-compressed serialized R list
mapping each variable to (offset, length) in the .rdb, where each object is a 4-byte big-endian
length followed by its zlib-compressed serialization (XDR format, version 2 or 3). The novels are
character vectors, one element per line. This reader handles the subset of the format those two
files use (vectors, pairlists, symbols, strings, references) and fails loudly on anything else.

usage: rdata_to_text.py PATH/Rdata OUTDIR
"""
import gzip
import struct
import sys
import zlib
from pathlib import Path


class Reader:
    def __init__(self, data):
        self.d, self.i, self.refs = data, 0, []

    def int(self):
        v = struct.unpack(">i", self.d[self.i:self.i + 4])[0]
        self.i += 4
        return v

    def bytes(self, n):
        b = self.d[self.i:self.i + n]
        self.i += n
        return b

    def header(self):
        fmt = self.bytes(2)
        if fmt != b"X\n":
            raise ValueError(f"not XDR serialization: {fmt!r}")
        version = self.int()
        self.int(), self.int()  # writer and minimal reader versions
        if version == 3:
            self.bytes(self.int())  # native encoding name
        return self.item()

    def item(self):
        flags = self.int()
        t, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if t == 254:  # NILVALUE
            return None
        if t in (242, 251, 252, 253):  # empty env, missing arg, base env, global env
            return None
        if t == 255:  # REFSXP
            idx = flags >> 8
            return self.refs[(idx if idx else self.int()) - 1]
        if t == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if t in (2, 4, 5, 6):  # LISTSXP, ENVSXP-like pairlists, LANGSXP: (attr)(tag) car cdr
            out = {}
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            out[tag] = car
            if isinstance(cdr, dict):
                out.update(cdr)
            return out
        if t == 9:  # CHARSXP
            n = self.int()
            return None if n == -1 else self.bytes(n).decode("utf-8", "replace")
        if t in (10, 13):  # LGLSXP, INTSXP
            n = self.int()
            v = list(struct.unpack(f">{n}i", self.bytes(4 * n)))
        elif t == 14:  # REALSXP
            n = self.int()
            v = list(struct.unpack(f">{n}d", self.bytes(8 * n)))
        elif t in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            n = self.int()
            v = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported R type {t} at byte {self.i}")
        attrs = self.item() if has_attr else None
        if t == 19 and isinstance(attrs, dict) and isinstance(attrs.get("names"), list):
            return dict(zip(attrs["names"], v))
        return v


def unserialize(blob):
    (n,) = struct.unpack(">I", blob[:4])
    data = zlib.decompress(blob[4:])
    assert len(data) == n, "length mismatch"
    return Reader(data).header()


def main():
    base, out = Path(sys.argv[1]), Path(sys.argv[2])
    index = Reader(gzip.decompress(base.with_suffix(".rdx").read_bytes())).header()
    rdb = base.with_suffix(".rdb").read_bytes()
    out.mkdir(parents=True, exist_ok=True)
    for name, (off, length) in index["variables"].items():
        value = unserialize(rdb[int(off):int(off) + int(length)])
        if isinstance(value, list) and value and all(isinstance(x, str) or x is None for x in value):
            text = "\n".join(x or "" for x in value) + "\n"
            (out / f"{name}.txt").write_text(text, encoding="utf-8")
            print(f"{name}: {len(value)} lines, {len(text)} chars")


if __name__ == "__main__":
    main()
