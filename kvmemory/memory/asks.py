"""Is it the same question? What a question asks for, compared with what a stored problem asked for.

Routing (memory/routing.py) lets a question reach a stored problem when it writes the same numbers;
a question that writes the same numbers and asks for another quantity ("how many muffins did it bake
before selling any?" against "how many muffins are left?") reaches it too, and the stored answer is
wrong for it (issue 48, item 2). Sentence embeddings cannot tell them apart: all-MiniLM-L6-v2 puts
"What was the total rainfall over those days?" at 0.90 from "What was the average daily rainfall?",
above most true rewordings' asks ("Balance in $ = ?" is 0.25 from "How much will she have after 8
weeks?"). So the ask is compared by what defines a quantity, read from the question sentence alone:

- its **measure**: its unit ("in meters" against "in square meters", hours against minutes, dollars
  against kilowatt-hours; one family of spellings per unit: "m^2", "square meters", "sq m"), else its
  dimension ("How far ...?" is a length, "How old ...?" a time), else what it counts ("how many eggs");
- its **aggregate** (what is left, a total, a share per one, a difference, a count before something
  happened, a part, a round trip...), read in the ask's head before its first number, only where both
  asks name one and they differ, or where the question adds one a rewording would not ("how many more
  ... than", "before"): "Total in $ = ?" names a total where its problem asked "How much do 2 adults and
  3 children pay?", which names none; and a share of what the stored ask counted ("each week" against
  "in 2 weeks");
- its **period** ("in 12 days" against "in a week");
- its **subject**: a name the question's ask adds where the problem's ask named someone ("How many
  marbles do Sam and Ann have together?" against "How many marbles does Sam have?"). A wider rule (any
  noun of the situation the question's ask names, "her brother", "the tip") was tried and dropped: it
  took 66 of 900 generated rewordings (bench/problems.py) for other asks ("How far does the tractor go
  altogether?" against "How many kilometres does he travel in total?").

`asks_differ(question, problem)` returns the first difference found, as a short reason, or None (no
difference seen: the question is taken to ask what the problem asked). The rules were written reading
the calibration set (bench/rewordings_calibration.py and bench/rewordings_other_asks.CALIBRATION), then
revised reading the report set's misses, so neither is held out; bench/data/asks_fresh.json was written
afterwards by an author who saw neither the rules nor the sets (BENCHMARKS.md, "Is it the same
question?", says which figures are blind).
"""

from __future__ import annotations

import re

__all__ = ["asks_differ", "ask_of", "other_asks"]

# Unit families: every spelling of a unit maps to one name. Longer spellings are matched first, so
# "square meters" is an area, not a length.
_UNIT_SPELLINGS = {
    "area_m": ["square meters", "square metres", "sq m", "m^2", "m2", "m²"],
    "area_cm": ["square centimeters", "square centimetres", "cm^2", "cm²"],
    "area_km": ["square kilometers", "square kilometres", "km^2", "km²"],
    "area_ft": ["square feet", "sq ft", "ft^2", "ft²"],
    "speed_kmh": ["kilometers per hour", "kilometres per hour", "km per hour", "km/h", "kph"],
    "speed_mph": ["miles per hour", "mph"],
    "km": ["kilometers", "kilometres", "kilometer", "kilometre", "km"],
    "m": ["meters", "metres", "meter", "metre", "m"],
    "cm": ["centimeters", "centimetres", "centimeter", "centimetre", "cm"],
    "mm": ["millimeters", "millimetres", "millimeter", "millimetre", "mm"],
    "mile": ["miles", "mile", "mi"],
    "kg": ["kilograms", "kilogram", "kilos", "kg"],
    "g": ["grams", "gram", "g"],
    "l": ["liters", "litres", "liter", "litre", "l"],
    "ml": ["milliliters", "millilitres", "ml"],
    "kwh": ["kilowatt-hours", "kilowatt hours", "kilowatt-hour", "kwh"],
    "h": ["hours", "hour", "hrs", "hr", "h"],
    "min": ["minutes", "minute", "mins", "min"],
    "s": ["seconds", "second", "secs", "sec", "s"],
    "day": ["days", "day"],
    "week": ["weeks", "week", "wk"],
    "year": ["years", "year", "yr", "yrs"],
    "usd": ["us dollars", "dollars", "dollar", "usd", "$"],
    "eur": ["euros", "euro", "eur", "€"],
    "degc": ["degrees celsius", "degrees", "°c"],
    "percent": ["percentage", "percent", "per cent", "%"],
}
_UNIT_OF = {s: name for name, spellings in _UNIT_SPELLINGS.items() for s in spellings}
# What each unit measures, and the asks that name a dimension without a unit ("How far ...?").
_DIMENSION = {"area_m": "area", "area_cm": "area", "area_km": "area", "area_ft": "area", "speed_kmh": "speed",
              "speed_mph": "speed", "km": "length", "m": "length", "cm": "length", "mm": "length",
              "mile": "length", "kg": "mass", "g": "mass", "l": "volume", "ml": "volume", "kwh": "energy",
              "h": "time", "min": "time", "s": "time", "day": "time", "week": "time", "year": "time",
              "usd": "money", "eur": "money", "degc": "temperature", "percent": "percent"}
_DIMENSION_CUES = [("length", r"\bhow far\b|\bdistance\b|\bperimeter\b|\bhow long is\b|\bhow high\b|\bhow tall\b"),
                   ("area", r"\barea\b"), ("time", r"\bhow long\b"), ("time", r"\bhow old\b|\bage\b"),
                   ("speed", r"\bspeed\b"), ("money", r"\bhow much\b.*\b(?:cost|pay|spend|earn|charge)|\bprice\b")]
# The period an ask is counted over ("in 12 days", "each night", "over a fortnight"): count and noun.
_PERIOD = re.compile(r"(?:\b(?:in|over|for|during|per|each|every|a|an|one)\s+(?:full\s+|whole\s+)?|(?=\d))(\d+(?:\.\d+)?\s+)?"
                     r"(minutes?|hours?|days?|nights?|weeks?|fortnights?|months?|years?)\b", re.I)
# The unit an ask is measured in, by the first of these that matches: "in <unit>" closing the ask
# ("How far does she walk in two weeks, in kilometers?"), "how many <unit>" / "what percent", then
# "in <unit>" anywhere, then a unit before "= ?".
_UNIT_ALT = "|".join(sorted((re.escape(s) for s in _UNIT_OF), key=len, reverse=True))
_UNIT_CUES = [re.compile(rf"\bin\s+({_UNIT_ALT})\s*(?:[?=,)]|$)", re.I),
              re.compile(rf"\b(?:how (?:many|much)|what)\s+(?:more\s+|fewer\s+|us\s+)??({_UNIT_ALT})(?![\w^²])", re.I),
              re.compile(rf"\bin\s+({_UNIT_ALT})(?![\w^²])", re.I),
              re.compile(rf"\(({_UNIT_ALT})\)", re.I),
              re.compile(rf"^({_UNIT_ALT})\b", re.I)]
_COUNTED = re.compile(r"\bhow many\s+([a-z]+)", re.I)

# Aggregates an ask can name. Each a set of cue patterns; an ask naming two is taken by the first listed.
_AGGREGATES = [
    ("difference", r"\b(?:more|less|fewer|longer|shorter|taller|older|younger|cheaper)\b.*\bthan\b|\bdifference\b"),
    ("before", r"\bbefore\b|\bat first\b|\bto begin with\b|\boriginally\b|\bin all\b.*\bhave\b"),
    ("remainder", r"\bleft\b|\bremain\w*\b|\bstill\b|\bunread\b|\bempty\b|\bchange\b|\bbalance\b|\bunused\b"),
    ("saving", r"\bsave[sd]?\b|\bsaving\b|\bdiscount\b"),
    ("round_trip", r"\bround trip\b|\bboth ways\b|\bthere and back\b"),
    ("part", r"\bhalf\b|\ba quarter\b|\ba third\b|\bfraction\b"),
    ("complement", r"\bnot\b|\bother than\b"),
    ("total", r"\btotal\b|\baltogether\b|\bin all\b|\btogether\b|\bcombined\b|\boverall\b|\bwhole\b"),
    ("share", r"(?<![\d%]\s)\b(?:each|per|every)\b|\baverage\b|\bmean\b"),
]
# Function words and generic words of an ask: never what it counts, nor a share's noun.
_STOP = set("""a an the of in on at to for from by with without and or but if then than as is are was were be been
being will would do does did has have had how many much what which who whom whose when where why it its it's
this that these those there their they them he him his she her hers you your we our us i me my mine one ones
can could should shall may might must not no all any some more most less least each per every whole total
altogether together over into after before during up down out off about total number amount price cost
get gets got need needs needed take takes make makes made go goes left remain remains still long far
tall old big high time times use uses used pay pays paid spend spends spent give given buy bought can age
there then now""".split())
_NOT_NOUNS = set("more fewer less times other different of".split())
# Aggregates a rewording would not add: asked against a stored ask naming none, they differ.
_MARKED = ("difference", "before", "saving", "round_trip", "part", "complement")
_NUMBER = re.compile(r"\d|\b(?:two|three|four|five|six|seven|eight|nine|ten|twelve|twenty|thirty|hundred)\b", re.I)
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")
_LEAD_CLAUSE = re.compile(r"^\s*(?:if|when|after|given that|since|assuming)\b[^,]*,\s*", re.I)
_TAIL_CLAUSE = re.compile(r"\s+\b(?:if|after|when|given that|since|assuming|who|that|which)\s+\S+\s+\S.*$", re.I)


def _ask_sentence(text: str) -> str:
    """The last sentence of `text` with a question mark, else its last sentence."""
    sentences = [s for s in re.split(r"(?<=[.?!])\s+", " ".join(text.split())) if s]
    asks = [s for s in sentences if "?" in s]
    return asks[-1] if asks else (sentences[-1] if sentences else "")


def ask_of(text: str) -> str:
    """The sentence of `text` that asks: its last one with a question mark (else its last sentence),
    without a leading or trailing condition ("If 35 students are on the bus, ...", "... if a bakery
    sells 87 muffins"), which restates the situation rather than the ask."""
    ask = _LEAD_CLAUSE.sub("", _ask_sentence(text))
    head = _TAIL_CLAUSE.sub("", ask)
    return head if len(head.split()) >= 2 else ask


def _unit(ask: str) -> str | None:
    for cue in _UNIT_CUES:
        m = cue.search(ask)
        if m:
            return _UNIT_OF.get(m.group(1).lower())
    return None


def _measure(ask: str) -> tuple[str, str | set[str]] | None:
    """What the ask is measured in or counts: ("unit", name), ("counted", the words after "how many"),
    ("dimension", name) for an ask that names one without a unit ("How far ...?"), or None."""
    unit = _unit(ask)
    if unit:
        return "unit", unit
    low = ask.lower()
    m = re.search(r"\bhow many\s+(.*)", low)
    if m:
        words = []
        for w in _WORD.findall(m.group(1)):
            if w in _STOP or w in _NOT_NOUNS:
                break
            words.append(_stem(w))
        if words:
            return "counted", set(words)
    for name, cue in _DIMENSION_CUES:
        if re.search(cue, low):
            return "dimension", name
    return None


def _measures_differ(q, p) -> bool:
    if q is None or p is None:
        return False
    (qk, qv), (pk, pv) = q, p
    if qk == pk == "counted":
        return not (qv & pv)
    if qk == pk:
        return qv != pv
    if "counted" in (qk, pk):
        counted, other = (qv, p) if qk == "counted" else (pv, q)
        unit_words = {_stem(w) for w, name in _UNIT_OF.items() if name == other[1] or _DIMENSION.get(name) == other[1]}
        return other[0] == "unit" and not (counted & unit_words)
    dims = [_DIMENSION.get(v, v) if k == "unit" else v for k, v in (q, p)]
    return dims[0] != dims[1]


def _period(ask: str) -> tuple[str, str] | None:
    m = _PERIOD.search(ask)
    if not m:
        return None
    count = (m.group(1) or "1").strip()
    return count, _stem(m.group(2)).removesuffix("s")


def _rates(text: str) -> str:
    """A rate's "per" written as a slash ("kilometers per hour" -> "kilometers/hour"): a unit of the
    quantity, not a share of it."""
    return re.sub(rf"\b({_UNIT_ALT})\s+per\s+([a-z]+)", r"\1/\2", text)


def _aggregate(ask: str) -> str | None:
    # Only the ask's head, before its first number: what follows restates the given quantities ("How long is
    # a trip of 3 legs of 47, 38 and 55 minutes, with a 12 minute stop between each leg and the next?")
    low = re.split(r"\d", _rates(ask.lower()), maxsplit=1)[0]
    for name, cue in _AGGREGATES:
        if re.search(cue, low):
            return name
    return None


def _stem(word: str) -> str:
    w = word.lower().removesuffix("'s")
    for suffix in ("ies", "es", "s"):
        if w.endswith(suffix) and len(w) - len(suffix) >= 3:
            return w[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return w


def asks_differ(question: str, problem: str) -> str | None:
    """Why `question` asks for another quantity than `problem` did (a short reason), or None."""
    q_ask, p_ask = ask_of(question), ask_of(problem)
    qm, pm = _measure(q_ask), _measure(p_ask)
    if _measures_differ(qm, pm):
        return f"measure: {_show(qm)} asked, {_show(pm)} stored"
    qa, pa = _aggregate(q_ask), _aggregate(p_ask)
    if qa != pa and ((qa and pa) or qa in _MARKED):
        return f"aggregate: {qa or 'none'} asked, {pa or 'none'} stored"
    if pa is None and _NUMBER.search(p_ask):
        # "each week" asked where the stored ask counted weeks ("in 2 weeks"): one part of the whole
        per = {_stem(w) for w in re.findall(r"(?<![\d%]\s)\b(?:each|per|every)\s+([a-z]+)", _rates(q_ask.lower()))}
        if (per - _STOP) & {_stem(w) for w in _WORD.findall(p_ask.lower())}:
            return "aggregate: share asked, total stored"
    qp, pp = _period(q_ask), _period(p_ask)
    if qp and pp and qp != pp:
        return f"period: {' '.join(qp)} asked, {' '.join(pp)} stored"
    # A name the question's ask adds where the stored ask named someone ("How many marbles do Sam and
    # Ann have together?" against "How many marbles does Sam have?").
    q_names, p_names = _names(q_ask), _names(p_ask)
    if p_names and q_names - p_names:
        return f"subject: {', '.join(sorted(q_names - p_names))}"
    return None


def _names(text: str) -> set[str]:
    """Capitalised words not opening a sentence: people's and places' names."""
    return {w.lower() for w in re.findall(r"(?<![.?!]\s)(?<!^)\b[A-Z][a-z]+", text.strip())} - _STOP


def _show(measure) -> str:
    kind, value = measure
    return ", ".join(sorted(value)) if kind == "counted" else value


def other_asks(question: str, entries) -> dict[str, str]:
    """{entry id: why} for the routed verified solutions (not notes) whose problem `question` asks another
    quantity of (`asks_differ`): their stored answers are not the question's."""
    from kvmemory.memory.verifiers import is_note

    out = {}
    for e in entries:
        if e.verified and not is_note(e) and e.answer is not None:
            why = asks_differ(question, e.problem)
            if why:
                out[e.id] = why
    return out
