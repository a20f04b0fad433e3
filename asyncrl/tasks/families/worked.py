"""Worked solutions for reasoning-gym's word problems: the program a cold start's transcripts run.

Owns turning what a generator gives into a `WorkedSolution` (a Python program that prints the
answer, with its words as comments or as a few sentences of reasoning), checked by running it:
- `gsm_symbolic`: its `answer_cot` steps (`35 × 3 = 105 kiwi`, `$79/hour * 7 hours = $553`,
  `#### 288`) become one variable per step, a later step naming an earlier one where its
  number is an earlier result, and the words of each step become a comment right above the
  line that computes it (`# He has 3 times as many kiwi` / `kiwi = 35 * 3`): the phrase and
  its operation sit side by side, so the solution has no separate reasoning. A step whose
  left side is not arithmetic (`48=48`), whose value is not what the line says, or whose
  numbers are in neither the question nor an earlier step (`72*0.25` for a question that says
  "dropped 54 of 72") is refused: the program would teach numbers from nowhere.
- `simple_equations` (`56 - 98*e = -1218`): a program that writes the gap between the sides
  as a function of the unknown and solves the linear equation it is.

Every program is run here (`run_trusted`: generated, trusted code, in process, a few builtins)
and kept only when it prints the gold answer; otherwise the problem has no worked solution
(None). Pure: same inputs, same program. Does not own: drawing the problems (`rgym`), how a
transcript shows the solution (`asyncrl.sft.coldstart`).
"""

from __future__ import annotations

import io
import keyword
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from asyncrl.tasks.task import WorkedSolution

_SAFE_BUILTINS = {f.__name__: f for f in (abs, int, max, min, round, str, sum)}


def run_trusted(code: str) -> str | None:
    """What `code` (generated here, trusted) prints, or None when it raises."""
    out = io.StringIO()

    def _print(*args: object) -> None:
        print(*args, file=out)

    try:
        exec(compile(code, "<worked>", "exec"), {"__builtins__": {**_SAFE_BUILTINS,
                                                                  "print": _print}})
    except Exception:  # a generated program that fails is simply not kept
        return None
    return out.getvalue()


# ------------------------------------------------------------------------- gsm_symbolic
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_TOKEN = re.compile(rf"(?P<num>{_NUM})(?P<pct>%)?|(?P<op>[-+*/×÷−()])|(?P<word>[A-Za-z']+)"
                    r"|(?P<stop>[,:;.!?=])|(?P<skip>[$€£¥\s]+)|(?P<other>.)")
_UNIT_SLASH = re.compile(r"/\s*(?=[A-Za-z])[A-Za-z]+")
"""`$79/hour`, `14 kilograms/duck`: a unit, not a division."""
_RESULT = re.compile(rf"^\s*[$€£¥]?\s*(?P<num>-?(?:{_NUM}))(?P<frac>/\d+)?(?P<pct>%)?")
_OPS = {"+": "+", "-": "-", "−": "-", "*": "*", "×": "*", "x": "*", "/": "/", "÷": "/",
        "(": "(", ")": ")"}
_MAX_WORDS = 6
"""Words an expression may hold between a number and its operator (`3 skeins per pair of leg
warmers + ...`); more, and the expression ends there."""
CONSTANTS = frozenset(Fraction(v) for v in (1, 2, 7, 10, 12, 24, 30, 52, 60, 100, 365, 1000))
"""Numbers a step may use without the question naming them: units of time, dozens, percent,
halving and doubling."""
_WORD_NUMBERS = {"half": (2, Fraction(1, 2)), "twice": (2,), "double": (2,), "triple": (3,),
                 "thrice": (3,), "quarter": (4, Fraction(1, 4)), "third": (3,), "dozen": (12,),
                 "one": (1,), "two": (2,), "three": (3,), "four": (4,), "five": (5,),
                 "six": (6,), "seven": (7,), "eight": (8,), "nine": (9,), "ten": (10,)}
_WORD_OPERANDS = {"half": Fraction(1, 2), "twice": Fraction(2), "double": Fraction(2),
                  "triple": Fraction(3)}
"""Words a cot writes where a number goes (`half * 188 beetles`)."""
_STOPWORDS = frozenset("""a an the of to for in on at by with and or so then thus first next
finally total he she they it his her their its is are was were be has have had that this these
those there which who what how many much more less than as per each every times find now
altogether therefore all left also can will would does did do""".split())
_LEAD = re.compile(r"^(?:[-•*]\s*|\d+\.\s+)")
_CONNECTORS = re.compile(r"^(?:so|thus|then|first|next|finally|therefore|and|or|now)\b[,\s]*",
                         re.IGNORECASE)
_TRAILING = re.compile(r"(?:[\s,:;]|\b(?:so|or|because|of|to|with|by|at|for a total of|"
                       r"for a total|for|which is|that's|this means|gives|we get|to get))+$",
                       re.IGNORECASE)


def _number(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def question_numbers(question: str) -> set[Fraction]:
    """Every number the question states (`30%` as 30 and 0.3; `twice` as 2)."""
    found: set[Fraction] = set()
    for m in re.finditer(rf"({_NUM})(%)?", question):
        v = _number(m.group(1))
        found |= {v, v / 100} if m.group(2) else {v}
    for word, values in _WORD_NUMBERS.items():
        if re.search(rf"\b{word}\b", question, re.IGNORECASE):
            found |= {Fraction(v) for v in values}
    return found


class Num(NamedTuple):
    """A number of a cot expression: its value and how the cot wrote it (`10.0`)."""

    value: Fraction
    text: str


Token = str | Num
"""An operator or parenthesis (as Python writes it), or a number."""
_PERCENT = Num(Fraction(100), "%")
"""The 100 of `40%` (`(40 / 100)`): never an earlier step's result."""


@dataclass
class Step:
    """One checked cot step: its expression, the result the line shows, and its words."""

    tokens: list[Token]
    shown: Num
    """The result as the line writes it (the value of the step for later steps)."""
    before: str
    """The words before the expression (`He has 3 times as many kiwi`)."""
    after: str
    """The words after the result (`kiwi`)."""

    @property
    def label(self) -> str:
        """The step in words: the words around its arithmetic, as a sentence."""
        said = {w.lower() for w in re.findall(r"[A-Za-z]+", self.before)}
        new = [w for w in re.findall(r"[A-Za-z]+", self.after) if w.lower() not in _STOPWORDS]
        fresh = new and not any(w.lower() in said for w in new)
        words = f"{self.before} {self.after}".strip() if fresh and len(said) < 10 \
            else self.before or self.after
        return words[:1].upper() + words[1:] if words else ""


def _expression_before(text: str) -> tuple[int, list[Token]] | None:
    """The arithmetic that ends `text`, read right to left: (where it starts, its tokens), or
    None. Words between an operator and the number to its left are units (`110 plants needed
    - 14`) and skipped; a word right before an operand ends the expression (`a total of 27*3`)."""
    toks = [m for m in _TOKEN.finditer(text) if m.lastgroup != "skip"]
    out: list[Token] = []
    want_operand, words, start = True, 0, len(text)
    for m in reversed(toks):
        kind, s = ("num" if m.group("num") else m.lastgroup), m.group()
        if kind == "word" and s == "x":
            kind = "op"
        if kind == "word" and want_operand and s.lower() in _WORD_OPERANDS and out:
            out.insert(0, Num(_WORD_OPERANDS[s.lower()], s))
            want_operand, words, start = False, 0, m.start()
        elif kind == "num" and (want_operand or out[:1] == ["("]):
            v = Num(_number(m.group("num")), m.group("num"))
            if not want_operand:  # `6(11)`: a number right before `(` multiplies it
                out.insert(0, "*")
            out[:0] = ["(", v, "/", _PERCENT, ")"] if m.group("pct") else [v]
            want_operand, words, start = False, 0, m.start()
        elif kind == "op" and s == ")" and want_operand:
            out.insert(0, ")")
        elif kind == "op" and s == "(" and not want_operand:
            out.insert(0, "(")
            start = m.start()
        elif kind == "op" and s not in "()" and not want_operand:
            out.insert(0, _OPS[s])
            want_operand, words = True, 0
        elif kind == "word" and want_operand and words < _MAX_WORDS:
            words += 1
        else:
            break
    while out and out[0] in ("*", "/", "+", "-", ")"):  # a dangling operator: not part of it
        out.pop(0)
    if sum(isinstance(t, Num) for t in out) < 2 or out.count("(") != out.count(")"):
        return None
    return start, out


def _value(tokens: list[Token]) -> Fraction | None:
    """The exact value of an expression (Python's precedence), or None."""
    expr = " ".join(f"Fraction({t.value.numerator}, {t.value.denominator})"
                    if isinstance(t, Num) else t for t in tokens)
    try:  # an expression built here from checked tokens: numbers, operators, parentheses
        v = eval(expr, {"__builtins__": {}, "Fraction": Fraction})
    except (ZeroDivisionError, SyntaxError, TypeError):
        return None
    return v if isinstance(v, Fraction) else Fraction(v)


def _close(value: Fraction, shown: Fraction, places: int) -> bool:
    """`value` written to `places` decimals is `shown` (cots round: `100/3 = 33.33`)."""
    return abs(value - shown) <= Fraction(1, 2 * 10**places) if places else value == shown


def _words_before(text: str) -> str:
    text = _LEAD.sub("", text.strip()).rstrip(" $€£¥")
    text = _CONNECTORS.sub("", _TRAILING.sub("", text)).strip()
    short = re.sub(r"\s+(?:is|are|was|were)$", "", text)
    return short if len(short.split()) >= 2 else text


def _words_after(text: str) -> str:
    tail = re.split(r"[.;!?](?:\s|$)|\bbecause\b", text, maxsplit=1)[0].strip(" ,")
    return re.sub(r"\s+", " ", tail)


def parse_steps(answer_cot: str) -> tuple[list[Step], int]:
    """The checked steps of a cot, in order, and how many `=` were refused (no arithmetic on
    the left, as in `48=48`, or a value that is not what the line shows)."""
    steps: list[Step] = []
    refused = 0
    for line in answer_cot.splitlines():
        line = _UNIT_SLASH.sub("", line)
        if line.lstrip().startswith("####") or "=" not in line:
            continue
        for eq in [m.start() for m in re.finditer("=", line)]:
            got = _expression_before(line[:eq])
            res = _RESULT.match(line[eq + 1:])
            if got is None or res is None:
                refused += 1
                continue
            start, tokens = got
            shown = _number(res.group("num"))
            if res.group("frac"):
                shown /= int(res.group("frac")[1:])
            if res.group("pct"):
                shown /= 100
            value = _value(tokens)
            if value is None or not _close(value, shown, len(res.group("num").partition(".")[2])):
                refused += 1
                continue
            text = res.group("num") + (res.group("frac") or "") + (res.group("pct") or "")
            steps.append(Step(tokens, Num(shown, text), _words_before(line[:start]),
                              _words_after(line[eq + 1 + res.end():])))
    return steps, refused


def _name(step: Step, taken: set[str], index: int) -> str:
    """A variable name for a step: two words of what its result counts (`green_blocks`), else
    of the words before it, else `step<index>`."""

    def content(text: str) -> list[str]:
        return [w.lower() for w in re.findall(r"[A-Za-z]+", text)
                if w.lower() not in _STOPWORDS and len(w) > 1]

    after, before = content(step.after), content(step.before)
    bases = (["_".join(after[:2]), "_".join([*before[-1:], after[0]]), "_".join(before[-2:])]
             if after else ["_".join(before[-2:])])
    base = next((b for b in bases if b and b not in taken), "") or bases[0] or f"step{index}"
    if keyword.iskeyword(base) or base in _SAFE_BUILTINS or base == "print":
        base += "_"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def _literal(num: Num) -> str:
    v = num.value
    if v.denominator == 1:
        return str(v.numerator)
    text = num.text.replace(",", "")
    if "." not in text or Fraction(text) != v:
        text = f"{float(v):.12g}"
        if Fraction(text) != v:
            raise ValueError(f"{v} has no short decimal")
    return text


def _source(step_i: int, num: Num, steps: list[Step], stated: set[Fraction]) -> int | None:
    """The earlier step a number of step `step_i` is the result of, or None for a literal.
    The latest earlier result written the same way (`10.0` after `= 10.0 liters`) wins; then
    a number the question states is a literal; then any earlier result of that value."""
    if num is _PERCENT:
        return None
    earlier = range(step_i - 1, -1, -1)
    same = next((j for j in earlier if steps[j].shown.text == num.text), None)
    if same is not None:
        return same
    if num.value in stated:
        return None
    return next((j for j in earlier if steps[j].shown.value == num.value), None)


def gsm_solution(question: str, answer_cot: str, gold: str) -> WorkedSolution | None:
    """A checked worked solution of a `gsm_symbolic` item, or None (see the module docstring)."""
    try:
        want = Fraction(gold.strip().replace(",", ""))
    except ValueError:
        return None
    steps, _ = parse_steps(answer_cot)
    # the answer is the last result of its value; a percentage's answer is its number (`= 34%`)
    final = next((i for i in range(len(steps) - 1, -1, -1)
                  if want in (steps[i].shown.value, steps[i].shown.value * 100
                              if steps[i].shown.text.endswith("%") else None)), None)
    if final is None:
        return None
    steps = steps[:final + 1]
    stated = question_numbers(question)
    refs: list[list[int | None]] = []
    for i, st in enumerate(steps):
        row: list[int | None] = []
        for t in st.tokens:
            j = _source(i, t, steps, stated) if isinstance(t, Num) else None
            if isinstance(t, Num) and j is None and t.value not in stated | CONSTANTS:
                return None  # a number from nowhere
            row.append(j)
        refs.append(row)
    used, todo = {final}, [final]  # only the steps the answer depends on
    while todo:
        for j in refs[todo.pop()]:
            if j is not None and j not in used:
                used.add(j)
                todo.append(j)
    names: dict[int, str] = {}
    taken: set[str] = set()
    lines: list[str] = []
    try:
        for i in sorted(used):
            names[i] = _name(steps[i], taken, i + 1)
            expr = " ".join(names[j] if j is not None else
                            _literal(t) if isinstance(t, Num) else t
                            for t, j in zip(steps[i].tokens, refs[i], strict=True))
            if steps[i].label:  # the step's words right above the line that computes it
                lines.append(f"# {' '.join(steps[i].label.split()).rstrip('.')}")
            lines.append(f"{names[i]} = {expr.replace('( ', '(').replace(' )', ')')}")
    except ValueError:
        return None
    places = len(gold.strip().partition(".")[2])
    last = names[final] if steps[final].shown.value == want else f"{names[final]} * 100"
    show = f"round({last}, {places})" if places else f"round({last})"
    program = "\n".join([*lines, f"print({show})"])
    if (run_trusted(program) or "").strip() != gold.strip():
        return None
    return WorkedSolution(program=program)


# --------------------------------------------------------------------- simple_equations
_EQUATION = re.compile(r"\b(?:for|of) (?P<var>[A-Za-z])\b[^:]*:\s*(?P<eq>[^=]+=[^=]+)$")
_EQ_CHARS = re.compile(r"^[-+*/() 0-9A-Za-z]+$")


def equation_solution(question: str, gold: str, equation: str = "",
                      variable: str = "") -> WorkedSolution | None:
    """A checked program solving a linear `simple_equations` item (`equation` and `variable`
    from its metadata, else read from the question), or None."""
    if not equation or not variable:
        m = _EQUATION.search(question.strip())
        if m is None:
            return None
        equation, variable = m.group("eq"), m.group("var")
    left, _, right = (s.strip() for s in equation.partition("="))
    if not (_EQ_CHARS.match(left) and _EQ_CHARS.match(right)) or len(variable) != 1:
        return None
    v = variable
    program = (f"def gap({v}):\n"
               f"    return ({left}) - ({right})\n"
               f"\n"
               f"# gap is linear in {v}: gap({v}) = gap(0) + slope * {v}\n"
               f"slope = gap(1) - gap(0)\n"
               f"{v} = -gap(0) / slope\n"
               f"print(round({v}))")
    if (run_trusted(program) or "").strip() != gold.strip():
        return None
    reasoning = (f"The equation is linear in {v}. I write the difference of its two sides as a "
                 f"function of {v} and find where it is zero.")
    return WorkedSolution(reasoning=reasoning, program=program)
