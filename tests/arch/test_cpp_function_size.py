"""No C++ function in csrc/ over 120 lines (issue 36 item 5): a function that grows past one
screen is split into helpers that each do one thing. A function is a top-level or member
function definition (a ``PYBIND11_MODULE`` body counts as one); a lambda inside it, such as
the body of a ``.def``, counts toward the function that holds it. Lines run from the first
line of the signature to the closing brace. Also: the byte-appending helper ``put_raw`` is
defined once. Reads the sources only; builds nothing."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}
LIMIT = 120


def blank_comments_and_strings(text: str) -> str:
    """`text` with comments, string and character literals (raw strings included) and
    preprocessor lines replaced by spaces, newlines kept, so line numbers stay right and no
    brace inside them is counted. A string literal leaves ``""`` behind."""
    out: list[str] = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if line_start and c == "#":  # a preprocessor line, with its continuations
            j = i
            while j < n and text[j] != "\n":
                j += 2 if text[j] == "\\" and j + 1 < n else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        line_start = c == "\n"
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "R" and text.startswith('"', i + 1) and not (i and (text[i - 1].isalnum()
                                                                   or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i + m.end())
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i and text[i - 1].isalnum():  # a digit separator: 1'000'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + c + " " * (j - i - 2) if j - i >= 2 else c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


TEMPLATE = re.compile(r"^\s*template\s*<")
ACCESS = re.compile(r"^\s*(?:public|private|protected)\s*:(?!:)")
# The end of a function head: `)` then qualifiers, an optional trailing return type.
FUNCTION_END = re.compile(
    r"\)\s*(?:const\b|volatile\b|noexcept\b(?:\s*\([^()]*\))?|override\b|final\b|mutable\b|&&|&|"
    r"->\s*[\w:<>,\s*&]+?|\s)*$")
# A constructor's member initializer list after its head: `) : a_(x), b_{y}`.
CTOR_INIT = re.compile(r"\)\s*(?:noexcept\b\s*)?:(?!:)")
CLASS_HEAD = re.compile(r"\b(?:class|struct|union)\b")
NAMESPACE_HEAD = re.compile(r"\bnamespace\b|\bextern\s*\"\"\s*$")


def strip_template_prefix(head: str) -> str:
    """`head` without a leading ``template <...>`` (its angle brackets matched)."""
    while TEMPLATE.match(head):
        depth, i = 0, head.index("<")
        for i in range(i, len(head)):
            depth += {"<": 1, ">": -1}.get(head[i], 0)
            if depth == 0:
                break
        head = head[i + 1:]
    return head


def classify(head: str) -> str:
    """What the `{` after `head` opens: 'function', 'class', 'namespace', 'init' (a brace
    initializer inside a constructor's member initializer list) or 'other'."""
    h = strip_template_prefix(ACCESS.sub("", head)).strip()
    if NAMESPACE_HEAD.search(h) and "(" not in h:
        return "namespace"
    if "(" in h and FUNCTION_END.search(h) and not h.rstrip(")").endswith("="):
        return "function"
    if "(" in h and CTOR_INIT.search(h):
        return "function" if h.endswith(("}", ")")) else "init"
    if CLASS_HEAD.search(h.split("(")[0]) and not h.endswith("="):
        return "class"
    return "other"


def match_brace(code: str, i: int) -> int:
    """The index of the `}` matching the `{` at `i`."""
    depth = 0
    for j in range(i, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, line count) of each function definition in the C++ `text`."""
    code = blank_comments_and_strings(text)
    found: list[tuple[str, int, int]] = []

    def scan(start: int, end: int) -> None:  # a namespace or class body
        head_start = start
        i = start
        while i < end:
            c = code[i]
            if c in ";}":
                head_start = i + 1
            elif c == "{":
                head = code[head_start:i]
                kind = classify(head)
                close = match_brace(code, i)
                if kind in ("namespace", "class"):
                    scan(i + 1, close)
                elif kind == "function":
                    lead = len(head) - len(ACCESS.sub("", head).lstrip())
                    first = head_start + lead
                    first_line = code.count("\n", 0, first) + 1
                    last_line = code.count("\n", 0, close) + 1
                    name = re.findall(r"([~\w:]+(?:\s*operator\s*[^\s(]+)?)\s*\(", head)
                    found.append((name[0] if name else "?", first_line,
                                  last_line - first_line + 1))
                if kind == "init":  # part of the head still: skip the braces, keep the head
                    i = close + 1
                    continue
                head_start = close + 1
                i = close
            i += 1

    scan(0, len(code))
    return found


def sources() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in SUFFIXES)


def test_the_scanner_measures_functions():
    src = (
        '#include "x.h"\n'                                   # 1
        "namespace cudasnap {\n"                             # 2
        "namespace {\n"                                      # 3
        "template <typename T>\n"                            # 4
        "void put(std::string& out, const T& v) {\n"         # 5
        '  out.append("}{", 2);  // } {\n'                   # 6
        "}\n"                                                # 7
        "}  // namespace\n"                                  # 8
        "struct Stats { int a{0}; double b = 1; };\n"        # 9
        "class Engine : public Base {\n"                     # 10
        " public:\n"                                         # 11
        "  Engine(int x) : x_(x), y_{x, 1} {\n"              # 12
        "    go();\n"                                        # 13
        "  }\n"                                              # 14
        "  int get() const noexcept { return x_; }\n"        # 15
        " private:\n"                                        # 16
        "  int x_, y_{2};\n"                                 # 17
        "};\n"                                               # 18
        "static const int kTable[] = {1, 2, 3};\n"           # 19
        "auto Engine::run(int n) -> int {\n"                 # 20
        "  auto f = [&](int k) {\n"                          # 21
        "    /* } */ return k + '}';\n"                      # 22
        "  };\n"                                             # 23
        '  return f(n) + R"x(})x"[0];\n'                      # 24
        "}\n"                                                # 25
        "PYBIND11_MODULE(_C, m) {\n"                         # 26
        '  m.def("f", [](int a) {\n'                         # 27
        "    return a;\n"                                    # 28
        "  });\n"                                            # 29
        "}\n"                                                # 30
        "}  // namespace cudasnap\n")                        # 31
    assert functions(src) == [("put", 4, 4), ("Engine", 12, 3), ("get", 15, 1),
                              ("Engine::run", 20, 6), ("PYBIND11_MODULE", 26, 5)]


def test_no_cpp_function_over_one_screen():
    long: dict[str, int] = {}
    n = 0
    for p in sources():
        for name, line, size in functions(p.read_text()):
            n += 1
            if size > LIMIT:
                long[f"{p.relative_to(ROOT).as_posix()}:{line} {name}"] = size
    assert n > 300, n  # the scan found the sources' functions
    assert not long, f"C++ functions over {LIMIT} lines (split them into helpers): {long}"


PUT_RAW_DEF = re.compile(r"\bput_raw\s*\([^;{}]*\)\s*\{")


def test_put_raw_is_defined_once():
    defs = []
    for p in sources():
        code = blank_comments_and_strings(p.read_text())
        defs += [f"{p.relative_to(ROOT).as_posix()}:{code.count(chr(10), 0, m.start()) + 1}"
                 for m in PUT_RAW_DEF.finditer(code)]
    assert len(defs) == 1, f"put_raw must be defined once, in a shared header: {defs}"
