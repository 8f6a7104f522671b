"""Training and held-out text for the three workload classes, from what every machine with
Python has: the standard library's source (code), its bundled documentation (chat/prose),
and seeded, generated records (extraction). Deterministic; no downloads."""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLASSES = ("code", "chat", "extraction")


@dataclass
class Corpus:
    train: dict[str, list[str]]  # class -> documents
    heldout: dict[str, list[str]]

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for split in (self.train, self.heldout):
            for cls in CLASSES:
                for doc in split[cls]:
                    h.update(doc.encode("utf-8", "replace"))
        return h.hexdigest()[:16]


def _is_heldout(name: str, share: float = 0.1) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < share


def _stdlib_sources(version: int) -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's Python files, test suites excluded.
    Version 1 walks them in sorted order (so a byte cap takes the packages from `a` on, codec
    tables included); version 2 leaves out the generated codec tables under `encodings/`
    (a third of version 1's code) and orders files by a hash of their path, so a cap samples
    the whole library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip: tuple[str, ...] = ("test/", "idlelib/", "site-packages/", "lib2to3/tests", "tkinter/test")
    if version >= 2:
        skip += ("encodings/",)
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(skip) or "/test" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if 500 <= len(text) <= 60_000:
            out.append((rel, text))
    if version >= 2:
        out.sort(key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())
    return out


def code_documents(max_bytes: int, version: int = 1) -> tuple[list[str], list[str]]:
    """Python source files of the standard library (see `_stdlib_sources`), up to max_bytes."""
    train: list[str] = []
    heldout: list[str] = []
    used = 0
    for rel, text in _stdlib_sources(version):
        (heldout if _is_heldout(rel) else train).append(text)
        used += len(text)
        if used >= max_bytes:
            break
    return train, heldout


def docstring_documents(version: int) -> list[tuple[str, str]]:
    """(module path, text): the standard library's longer docstrings (module, class, function; at
    least 200 characters), one document per module, as English prose beside the pydoc topics
    (which are only 0.46 MB). Version 1 of the corpus has none."""
    if version < 2:
        return []
    out = []
    for rel, text in _stdlib_sources(version):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        docs = [d for node in ast.walk(tree)
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and (d := ast.get_docstring(node)) and len(d) >= 200]
        if docs:
            out.append((rel, "\n\n".join(docs) + "\n"))
    return out


def prose_documents(max_bytes: int, version: int = 1) -> tuple[list[str], list[str]]:
    """The Python documentation shipped in the standard library (pydoc topics), then (corpus
    version 2) the library's docstrings, in chunks of about 4,000 characters."""
    from pydoc_data.topics import topics  # always present with CPython

    train: list[str] = []
    heldout: list[str] = []
    used = 0
    # a topic's chunks are split one by one; a module's docstrings go where its code goes
    # (held out with it), so held-out prose never appears in the training code
    sources: list[tuple[str, str, bool | None]] = [(name, topics[name].strip(), None) for name in sorted(topics)]
    sources += [(rel, text, _is_heldout(rel)) for rel, text in docstring_documents(version)]
    for name, text, held in sources:
        for i, para_block in enumerate(_chunks(text, 4000)):
            key = f"{name}/{i}"
            (heldout if (_is_heldout(key) if held is None else held) else train).append(para_block)
            used += len(para_block)
        if used >= max_bytes:
            break
    return train, heldout


def _chunks(text: str, size: int) -> list[str]:
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) > size:
            out.append(cur)
            cur = ""
        cur += para + "\n\n"
    if cur.strip():
        out.append(cur)
    return out


_FIRST = ["Maria", "John", "Aiko", "Lars", "Fatima", "Chen", "Olga", "Pedro", "Amara", "Noah",
          "Ines", "Ravi", "Sofia", "Tomas", "Yuki", "Hana", "Omar", "Lena", "Mateo", "Zara"]
_LAST = ["Gonzalez", "Smith", "Tanaka", "Nilsson", "Haddad", "Wei", "Petrova", "Silva", "Okafor",
         "Brown", "Moreau", "Patel", "Rossi", "Novak", "Sato", "Kim", "Farouk", "Weber", "Diaz", "Ali"]
_CITIES = ["Porto", "Lyon", "Osaka", "Malmo", "Beirut", "Chengdu", "Kazan", "Recife", "Lagos",
           "Denver", "Nantes", "Pune", "Turin", "Brno", "Sendai", "Busan", "Cairo", "Graz"]
_ITEMS = ["widget", "gadget", "cable", "adapter", "sensor", "battery", "keyboard", "monitor",
          "router", "charger", "lamp", "fan", "speaker", "camera", "drive", "hub"]
_STATUS = ["paid", "pending", "shipped", "refunded", "cancelled"]


def _record(rng: random.Random) -> tuple[str, dict[str, Any]]:
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    rec: dict[str, Any] = {
        "id": rng.randint(1000, 99999),
        "name": f"{first} {last}",
        "email": f"{first.lower()}.{last.lower()}@example.org",
        "city": rng.choice(_CITIES),
        "age": rng.randint(18, 90),
        "status": rng.choice(_STATUS),
        "items": [
            {"sku": rng.choice(_ITEMS), "qty": rng.randint(1, 20), "price": round(rng.uniform(1, 500), 2)}
            for _ in range(rng.randint(1, 3))
        ],
        "date": f"20{rng.randint(18, 26):02d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
    }
    style = rng.randrange(3)
    return render_record(rec, style), rec


def render_record(rec: dict[str, Any], style: int) -> str:
    """A record as the corpus writes it in one of its three styles (0: lines, 1: prose,
    2: key=value pairs)."""
    items_text = "; ".join(f"{it['qty']} x {it['sku']} at {it['price']}" for it in rec["items"])
    if style == 0:
        return "\n".join(
            [f"Record {rec['id']}", f"name: {rec['name']}", f"email: {rec['email']}",
             f"city: {rec['city']}", f"age: {rec['age']}", f"status: {rec['status']}",
             f"date: {rec['date']}", f"items: {items_text}"]
        )
    if style == 1:
        return (f"Order {rec['id']} from {rec['name']} ({rec['email']}), {rec['age']}, living in "
                f"{rec['city']}, placed on {rec['date']} and is {rec['status']}: {items_text}.")
    return ", ".join(f"{k}={v}" for k, v in rec.items() if k != "items") + f", items={items_text}"


def extraction_document(rng: random.Random) -> str:
    source, rec = _record(rng)
    return f"Extract the record as JSON.\nText: {source}\nJSON: {json.dumps(rec)}\n"


def extraction_documents(n_train: int, n_heldout: int, seed: int) -> tuple[list[str], list[str]]:
    train_rng, held_rng = random.Random(seed), random.Random(seed + 7919)
    train = ["".join(extraction_document(train_rng) for _ in range(4)) for _ in range(n_train)]
    heldout = [extraction_document(held_rng) for _ in range(n_heldout)]
    return train, heldout


def build_corpus(code_bytes: int, prose_bytes: int, n_extraction: int, seed: int, version: int = 1) -> Corpus:
    code_tr, code_ho = code_documents(code_bytes, version)
    prose_tr, prose_ho = prose_documents(prose_bytes, version)
    ext_tr, ext_ho = extraction_documents(n_extraction, 64, seed)
    return Corpus(
        train={"code": code_tr, "chat": prose_tr, "extraction": ext_tr},
        heldout={"code": code_ho, "chat": prose_ho, "extraction": ext_ho},
    )
