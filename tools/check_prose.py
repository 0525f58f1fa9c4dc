"""Check that every number in a notebook's prose is computed, declared, or exempt by form.

The rule (BOOK.md section 5): a number the notebook computes appears in a markdown cell
only where a code cell of the same section asserts it or prints it. This tool makes that
mechanical. Every number in markdown prose (digits, ``12.5 %``, ratios ``34/20``,
``15x`` / ``15×`` / ``15 times``, and the number words ``two`` ... ``twenty``, ``thirty``
... ``ninety``, ``hundred``, ``thousand``, ``twice``, ``half``, ``double``, ``dozen``)
must be one of:

(a) **exempt by form**: inside a code span, a fenced block, LaTeX (``$...$``), an HTML
    comment, a link's target or a heading; a list marker (``1.``); a reference
    (``chapter 07``, ``chapters 02-06``, ``section 3``, ``§2.2``, ``exercise 9.1``,
    ``Theorem 3.1``, ``question 4``, ``item 2``, ``cell``, ``table``, ``figure``,
    ``appendix``, ``part``); a version (``0.5.23``, ``v1``); an arXiv id or CVE; a year
    (1950-2035 after a venue or an author list, or before ``)``/``,``/``.``/``;``);
    a number glued to letters (``H100``, ``fp32``, ``bf16``, ``8B``, ``x16``,
    ``Llama-3-8B``, ``3rd``). The word ``one`` and ordinals (``first``, ``second``) are
    not counted: they are mostly not quantities.

(b) **tagged** to a computed value with an invisible marker right after it:
    ``80 %<!--=reuse_pct-->``, ``34/20<!--=lone_ratio-->``, ``eight<!--=n_cached-->``.
    The name must be defined by a code cell of the same section, either in its stored
    output as a printed ``name = value`` / ``name: value`` / ``'name': value`` (a dict
    printed whole counts), or in its source as ``name == <literal>`` (an assert). All
    definitions found must agree. The prose number must equal the value at the prose's
    own precision: ``15`` matches 15.38, ``2.25`` matches 2.2499, ``34/20`` matches
    only ``34/20``; ``80 %`` compares 80 with the value (print percentages as
    percentages).

(c) **declared** as a fixed fact (an input the author chose, a fact read from upstream
    source, plain arithmetic of the text, the threshold of an asserted claim such as
    "more than twice", or a value a code cell of the section asserts through an
    expression, ``== 65 + 3``, that no tag can name) in the markdown cell's metadata,
    ``metadata["prose_numbers"]``: a list of keys, each the number with up to two words
    on either side, lower-cased, punctuation dropped (``"of 20 common tokens"``). An
    edit to the sentence around the number changes its key, so the declaration no
    longer covers it and the number is flagged again. A declaration that matches
    nothing in its cell is reported as stale.

**Sections** are delimited by markdown headings (any level, and a heading in the middle
of a markdown cell starts a new section there). A section whose heading names a
**Summary** or a **Quiz** (its answers included) may use values defined anywhere in
the notebook.

Usage::

    python tools/check_prose.py                      # every notebook in chapters/, solutions/
    python tools/check_prose.py NB.ipynb ...         # these notebooks
    python tools/check_prose.py --count              # untagged numbers per notebook, read only
    python tools/check_prose.py --accept NB.ipynb    # declare NB's current untagged numbers
    python tools/check_prose.py --accept NB --cell ID  # ... in one cell only
    python tools/check_prose.py --accept --baseline NB # ... as a baseline, not yet reviewed

Check mode prints one line per problem (notebook, cell id, the number, its sentence) and
exits 1 if there is any.

**Adopting a notebook** (``--accept``): first tag every number the notebook computes
(print it as ``name = value`` in a code cell of its section if nothing prints or asserts
it yet, re-execute, and put ``<!--=name-->`` after the number in the prose); then run
``--accept`` on the notebook, which writes, for every markdown cell, the keys of its
numbers that are still neither exempt nor tagged into ``metadata["prose_numbers"]``
(and drops stale keys); review that diff (every declared key must be a fixed fact, not
a computed number), then add the notebook to ``ADOPTED`` below (the notebooks whose
every number is tagged or reviewed). ``--accept --baseline`` writes the keys under
``metadata["prose_numbers_baseline"]`` instead: numbers accepted in bulk, as they stood
after a reading, so that the check guards every later edit while the review of each
number is still to do; ``--count`` shows how many each notebook still has. ``--accept`` never
touches a tag and refuses to run while a tag mismatches, so it cannot paper over a
wrong computed value. It rewrites only the notebook's cell metadata, in nbformat's own
layout; run ``tools/make_exercises.py`` after accepting a solution notebook.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent

# Notebooks whose every prose number is tagged or declared after review (no baseline).
# `make test` checks every notebook; the rest still carry a baseline (see the docstring).
ADOPTED = [
    "chapters/07_scheduling.ipynb",
    "chapters/09_beyond.ipynb",
    "chapters/09b_real_traffic.ipynb",
    "chapters/09c_kv_events.ipynb",
    "chapters/11_hybrid.ipynb",
    "chapters/12_hit_rate.ipynb",
    "chapters/13_speculative.ipynb",
    "solutions/07_scheduling.ipynb",
    "solutions/09b_real_traffic.ipynb",
    "solutions/09c_kv_events.ipynb",
    "solutions/11_hybrid.ipynb",
    "solutions/12_hit_rate.ipynb",
    "solutions/13_speculative.ipynb",
]

META_KEY = "prose_numbers"
BASELINE_KEY = "prose_numbers_baseline"
GLOBAL_SECTION = re.compile(r"\b(summary|quiz)\b", re.I)

WORDS = {
    "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14,
    "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19,
    "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
    "eighty": 80, "ninety": 90, "hundred": 100, "thousand": 1000, "twice": 2,
    "half": 0.5, "double": 2, "dozen": 12, "triple": 3,
}
_DIGITS = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:e-?\d+)?"
NUMBER = re.compile(
    r"(?<![\w.])(?<![A-Za-z]-)"                  # not glued to a word or a model name
    rf"(?P<num>(?:{_DIGITS})(?:/(?:{_DIGITS}))?)"
    r"(?P<unit>\s?%|\s?percent\b|\s?[x×](?![\w])|\s+times\b)?"
    r"(?![\w])(?!\.\d)"
    r"|(?<![\w-])(?P<word>" + "|".join(sorted(WORDS, key=len, reverse=True)) + r")(?![\w-])",
    re.I)
TAG = re.compile(r"\s?<!--=(?P<name>[^>]*?)-->")
VALUE = rf"-?(?:{_DIGITS})(?:/(?:{_DIGITS}))?"

# Regions whose numbers are exempt by form (blanked out before numbers are read).
_BLANK = [
    re.compile(r"```.*?```", re.S),
    re.compile(r"<!--(?!=).*?-->", re.S),        # comments, not tags
    re.compile(r"``[^`]*``|`[^`\n]*`"),
    re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$", re.S),
    re.compile(r"\]\([^)]*\)"),                  # a link's target (its text is prose)
    re.compile(r"<[a-zA-Z/][^>\n]*>"),           # HTML tags
    re.compile(r"(?im)^\s{0,3}#.*$"),            # headings
    re.compile(r"(?m)^\s*\d+[.)]\s"),            # list markers
    re.compile(r"\b(?:arXiv:\s?\S+|CVE-[\d-]+|PR\s?#\d+|#\d+)", re.I),
    re.compile(r"(?<![\w.])v?\d+\.\d+\.\d+(?:\.\d+)*\b"),   # versions
    re.compile(r"\b(?:PCIe|Python|CUDA|ROCm|HTTP/?|Ubuntu|Debian|OpenAI API v?)\s?\d+(?:\.\d+)*"),
    re.compile(r"(?<![\w.])v\d+\b"),
    re.compile(r"(?:§\s?\d[\w.]*)(?:\s*(?:-|–|,|and|or|to)\s*§?\s?\d[\w.]*)*"),
    re.compile(r"\b(?:chapters?|sections?|exercises?|theorem|lemma|figure|fig\.|table|appendix"
               r"|parts?|items?|questions?|answers?|quiz|cells?|listing|equation|eq\.|step \d+\.\d"
               r")\s+\d[\w.]*(?:\s*(?:-|–|,|and|or|to)\s*\d[\w.]*)*", re.I),
    re.compile(r"\b(?:NeurIPS|ICML|ICLR|SIGCOMM|EuroSys|FAST|NDSS|OSDI|SOSP|ASPLOS|MLSys|ISCA"
               r"|VLDB|SIGMOD|ACL|EMNLP|NSDI|ATC|et al\.,?|USENIX|IEEE|ACM)\s+(?:19|20)\d\d\b"),
    re.compile(r"(?<![\w.,])(?:19[5-9]\d|20[0-3]\d)(?=[),.;:]|\s*$)", re.M),
    TAG,
]


@dataclass
class Number:
    """One number in a markdown cell."""
    cell: str
    text: str          # as written, e.g. "34/20", "80 %", "eight", "15 times"
    value: float | tuple[float, float]
    decimals: int
    start: int
    end: int
    key: str
    sentence: str
    tag: str | None = None


@dataclass
class Problem:
    notebook: str
    cell: str
    number: str
    what: str
    sentence: str

    def __str__(self) -> str:
        return f"{self.notebook} [{self.cell}] {self.number!r}: {self.what}\n    | {self.sentence}"


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    untagged: int = 0          # numbers neither exempt nor tagged (declared or not)
    tagged: int = 0
    declared: int = 0
    baseline: int = 0          # declared under BASELINE_KEY: accepted in bulk, not reviewed


def _blank(text: str) -> str:
    """The markdown with every exempt region replaced by spaces (offsets kept)."""
    tags = [(m.start(), m.end()) for m in TAG.finditer(text)]
    out = list(text)
    for pat in _BLANK:
        for m in pat.finditer("".join(out)):
            if any(a <= m.start() < b for a, b in tags):
                continue
            for i in range(m.start(), m.end()):
                if out[i] != "\n":
                    out[i] = " "
    return "".join(out)


def _parse_value(s: str) -> tuple[float | tuple[float, float], int]:
    s = s.replace(",", "").strip()
    if "/" in s:
        a, b = s.split("/")
        return (float(a), float(b)), 0
    dec = len(s.split(".")[1]) if "." in s and "e" not in s.lower() else 0
    return float(s), dec


_WORD = re.compile(r"[\w%/.×'-]+")


def _key(text: str, start: int, end: int) -> str:
    """The number with up to two words either side, lower-case, punctuation dropped."""
    def words(s: str) -> list[str]:
        out = []
        for w in _WORD.findall(TAG.sub("", s)):
            w = w.strip(".'-").lower()
            if w:
                out.append(w)
        return out
    line_start = text.rfind("\n\n", 0, start)
    line_end = text.find("\n\n", end)
    before = words(text[line_start + 1 if line_start >= 0 else 0:start])[-2:]
    after = words(text[end:line_end if line_end >= 0 else len(text)])[:2]
    middle = " ".join(text[start:end].lower().split())
    return " ".join(before + [middle] + after)


def _sentence(text: str, start: int, end: int) -> str:
    a = max(text.rfind(". ", 0, start), text.rfind("\n\n", 0, start), text.rfind(": ", 0, start))
    b_candidates = [i for i in (text.find(". ", end), text.find("\n\n", end)) if i >= 0]
    b = min(b_candidates) + 1 if b_candidates else len(text)
    return " ".join(TAG.sub("", text[a + 1 if a >= 0 else 0:b]).split())[:300]


def numbers_in(cell_id: str, text: str) -> list[Number]:
    """Every number of a markdown cell that is not exempt by form, with its tag if any."""
    blank = _blank(text)
    found = []
    for m in NUMBER.finditer(blank):
        if m.group("word"):
            value: float | tuple[float, float] = WORDS[m.group("word").lower()]
            dec = 0
        else:
            value, dec = _parse_value(m.group("num"))
        tag_m = TAG.match(text, m.end())
        found.append(Number(cell_id, text[m.start():m.end()], value, dec, m.start(), m.end(),
                            _key(text, m.start(), m.end()), _sentence(text, m.start(), m.end()),
                            tag_m.group("name").strip() if tag_m else None))
    return found


def _definitions(name: str, cells: list) -> set[str]:
    """The values a code cell gives ``name``: printed ``name = v`` / ``name: v`` in its
    stored output, or ``name == v`` in its source."""
    n = re.escape(name)
    printed = re.compile(rf"(?<![\w.])['\"]?{n}['\"]?\s*(?:=|:)\s*(?P<v>{VALUE})(?![\w.]*\d)")
    asserted = re.compile(rf"(?<![\w.]){n}\s*==\s*(?P<v>{VALUE})(?![\w.(\[])"
                          rf"|(?<![\w.])(?P<w>{VALUE})\s*==\s*{n}(?![\w.(\[])")
    values = set()
    for cell in cells:
        for out in cell.get("outputs", []):
            txt = out.get("text") or out.get("data", {}).get("text/plain", "")
            txt = "".join(txt) if isinstance(txt, list) else txt
            values.update(m.group("v") for m in printed.finditer(txt))
        src = cell.source
        values.update(m.group("v") or m.group("w") for m in asserted.finditer(src))
    return values


def _matches(num: Number, value: str) -> bool:
    v, _ = _parse_value(value)
    if isinstance(num.value, tuple) or isinstance(v, tuple):
        return num.value == v
    return round(v, num.decimals) == round(num.value, num.decimals)


def _sections(nb) -> list[tuple[str, int, str, int, int, str]]:
    """(cell id, section number, section title, text start, text end, cell type) pieces."""
    pieces = []
    title, sec = "", 0
    for cell in nb.cells:
        cid = cell.get("id", "?")
        if cell.cell_type != "markdown":
            pieces.append((cid, sec, title, 0, 0, cell.cell_type))
            continue
        text = cell.source
        start = 0
        in_fence = False
        pos = 0
        for line in text.splitlines(keepends=True):
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
            if not in_fence and re.match(r"\s{0,3}#{1,6}\s", line):
                if pos > start:
                    pieces.append((cid, sec, title, start, pos, "markdown"))
                title, sec = line.strip().lstrip("#").strip(), sec + 1
                start = pos
            pos += len(line)
        pieces.append((cid, sec, title, start, len(text), "markdown"))
    return pieces


def check_notebook(nb, name: str = "<notebook>") -> Report:
    """Check one notebook (a ``nbformat`` node); returns its problems and counts."""
    report = Report()
    by_id = {c.get("id", "?"): c for c in nb.cells}
    pieces = _sections(nb)
    code_by_section: dict[int, list] = {}
    for cid, sec, _, _, _, kind in pieces:
        if kind == "code":
            code_by_section.setdefault(sec, []).append(by_id[cid])
    all_code = [c for c in nb.cells if c.cell_type == "code"]
    keys_seen: dict[str, set[str]] = {}
    for cid, sec, title, a, b, kind in pieces:
        if kind != "markdown":
            continue
        cell = by_id[cid]
        text = cell.source
        declared = set(cell.get("metadata", {}).get(META_KEY, []))
        baseline = set(cell.get("metadata", {}).get(BASELINE_KEY, []))
        seen = keys_seen.setdefault(cid, set())
        scope = all_code if GLOBAL_SECTION.search(title) else code_by_section.get(sec, [])
        for num in numbers_in(cid, text):
            if not a <= num.start < b:
                continue
            seen.add(num.key)
            if num.tag is not None:
                report.tagged += 1
                defs = _definitions(num.tag, scope) if num.tag else set()
                if not defs:
                    report.problems.append(Problem(
                        name, cid, num.text, f"tagged {num.tag!r}, but no code cell of "
                        f"section {title!r} prints or asserts it", num.sentence))
                elif len({_parse_value(d)[0] for d in defs}) > 1:
                    report.problems.append(Problem(
                        name, cid, num.text, f"tag {num.tag!r} is ambiguous in section "
                        f"{title!r}: {sorted(defs)}", num.sentence))
                elif not _matches(num, next(iter(defs))):
                    report.problems.append(Problem(
                        name, cid, num.text, f"the code says {num.tag} = {next(iter(defs))}",
                        num.sentence))
                continue
            report.untagged += 1
            if num.key in declared:
                report.declared += 1
                continue
            if num.key in baseline:
                report.baseline += 1
                continue
            report.problems.append(Problem(
                name, cid, num.text, f"neither tagged nor declared (key {num.key!r})",
                num.sentence))
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        cid = cell.get("id", "?")
        meta = cell.get("metadata", {})
        declared = set(meta.get(META_KEY, [])) | set(meta.get(BASELINE_KEY, []))
        for key in sorted(declared - keys_seen.get(cid, set())):
            report.problems.append(Problem(name, cid, key, "stale declaration: no such number "
                                           "in the cell now", ""))
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        attached = {n.end for n in numbers_in(cell.get("id", "?"), cell.source)
                    if n.tag is not None}
        for m in TAG.finditer(cell.source):
            if m.start() not in attached:
                report.problems.append(Problem(name, cell.get("id", "?"), m.group(0).strip(),
                                               "tag not right after a number", _sentence(
                                                   cell.source, m.start(), m.end())))
    return report


def accept(nb, name: str = "<notebook>", cell_ids: set[str] | None = None,
           baseline: bool = False) -> int:
    """Declare ``nb``'s untagged, non-exempt numbers in each markdown cell's metadata
    (only the cells in ``cell_ids`` if given), dropping stale keys. Refuses (SystemExit)
    while a tag fails. Returns the number of keys written. ``baseline``: write the keys
    not already declared under ``BASELINE_KEY`` instead, as not yet reviewed one by one."""
    tag_problems = [p for p in check_notebook(nb, name).problems
                    if p.what.startswith(("tagged", "tag ", "the code says"))]
    if tag_problems:
        raise SystemExit("fix the tags first:\n" + "\n".join(map(str, tag_problems)))
    written = 0
    for cell in nb.cells:
        cid = cell.get("id", "?")
        if cell.cell_type != "markdown" or (cell_ids is not None and cid not in cell_ids):
            continue
        keys = list(dict.fromkeys(n.key for n in numbers_in(cid, cell.source) if n.tag is None))
        reviewed = set(cell.metadata.get(META_KEY, [])) if baseline else set()
        kept = [k for k in keys if k in reviewed]
        new = [k for k in keys if k not in reviewed]
        for meta_key in (META_KEY, BASELINE_KEY):  # stale keys go, from both lists
            cell.metadata.pop(meta_key, None)
        if kept:
            cell.metadata[META_KEY] = kept
        if new:
            cell.metadata[BASELINE_KEY if baseline else META_KEY] = new
            written += len(new)
    return written


def book_notebooks() -> list[Path]:
    return [p for d in ("chapters", "solutions") for p in sorted((ROOT / d).glob("*.ipynb"))]


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--accept", action="store_true",
                    help="write declarations for the notebooks' current untagged numbers")
    ap.add_argument("--cell", action="append", help="with --accept: only this cell id")
    ap.add_argument("--baseline", action="store_true",
                    help="with --accept: declare under prose_numbers_baseline, not yet reviewed")
    ap.add_argument("--count", action="store_true",
                    help="print untagged numbers per notebook (declared or not); read only")
    args = ap.parse_args(argv)
    paths = args.notebooks or book_notebooks()
    if args.accept:
        if not args.notebooks:
            ap.error("--accept needs the notebooks named")
        for p in paths:
            nb = nbformat.read(p, as_version=4)
            n = accept(nb, _rel(p), set(args.cell) if args.cell else None, args.baseline)
            nbformat.write(nb, p)
            print(f"{_rel(p)}: {n} numbers declared")
        return 0
    failed = 0
    for p in paths:
        nb = nbformat.read(p, as_version=4)
        rep = check_notebook(nb, _rel(p))
        if args.count:
            undeclared = sum(1 for x in rep.problems if x.what.startswith("neither"))
            print(f"{_rel(p):40s} untagged {rep.untagged:4d} (undeclared {undeclared:4d}, "
                  f"baseline {rep.baseline:4d}) tagged {rep.tagged:3d}")
            continue
        for prob in rep.problems:
            print(prob)
        failed += len(rep.problems)
        if not rep.problems:
            print(f"{_rel(p)}: ok ({rep.tagged} tagged, {rep.declared} declared"
                  + (f", {rep.baseline} in the baseline" if rep.baseline else "") + ")")
    if failed:
        print(f"{failed} problem(s): tag each computed number (<!--=name-->) to a value its "
              "section prints or asserts, or declare a fixed fact (tools/check_prose.py --accept)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
