"""Seeded arithmetic word problems, their rewordings and unrelated questions: the benches' data.

This is the data side of the router calibration and of the end-to-end benchmarks: `generate_problems`
makes multi-step (2-4 step) word problems with exact integer answers and a worked solution that the
`ArithmeticVerifier` (kvmemory.memory.verifiers) can re-check; `reword` paraphrases a problem (same
numbers, same meaning, other wording and sentence order) so routing can be tested on questions the
library never saw verbatim; `unrelated_questions` makes questions that must route to nothing.

Everything is deterministic per seed (`random.Random`, never the global generator), so a calibration
or a benchmark can be re-run and give the same questions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from kvmemory.errors import InvalidInput

__all__ = [
    "Problem",
    "generate_problems",
    "reword",
    "unrelated_questions",
]


@dataclass(slots=True, frozen=True)
class Problem:
    """One word problem. `steps` is a worked solution whose last line is 'The answer is N.'.

    `family` and `params` are the structured form the text was rendered from; `reword` renders them
    again with other wording, which is why rewordings keep the numbers and the meaning exactly.
    """

    id: str
    text: str
    answer: int
    steps: list[str]
    rewordings: list[str]
    family: str = ""
    params: dict = field(default_factory=dict)

    @property
    def solution(self) -> str:
        """The worked solution as one text (what a verifier is given)."""
        return "\n".join(self.steps)


# ---------------------------------------------------------------------------------------------------
# Vocabulary. The library vocabulary and the foreign one are disjoint on purpose: unrelated arithmetic
# questions are rendered from the foreign one, so "an arithmetic problem about entities never in the
# library" is true by construction and the router threshold is calibrated against exactly that.
# ---------------------------------------------------------------------------------------------------

_LIB_NAMES = [
    ("Mara", "she"), ("Tomas", "he"), ("Aisha", "she"), ("Bruno", "he"), ("Keiko", "she"), ("Diego", "he"),
    ("Ingrid", "she"), ("Felix", "he"), ("Leila", "she"), ("Oscar", "he"), ("Nadia", "she"), ("Victor", "he"),
    ("Priya", "she"), ("Samuel", "he"), ("Hana", "she"), ("Marco", "he"), ("Elena", "she"), ("Jonas", "he"),
    ("Fatima", "she"), ("Lukas", "he"), ("Chloe", "she"), ("Rafael", "he"), ("Yuki", "she"), ("Emil", "he"),
    ("Amara", "she"), ("Hugo", "he"), ("Sofia", "she"), ("Arjun", "he"), ("Greta", "she"), ("Pablo", "he"),
    ("Nora", "she"), ("Kwame", "he"), ("Lucia", "she"), ("Henrik", "he"), ("Zara", "she"), ("Mateo", "he"),
    ("Olga", "she"), ("Tariq", "he"), ("Beatriz", "she"), ("Dmitri", "he"), ("Imani", "she"), ("Finn", "he"),
    ("Rosa", "she"), ("Kenji", "he"), ("Astrid", "she"), ("Omar", "he"), ("Mei", "she"), ("Carlos", "he"),
    ("Sanne", "she"), ("Idris", "he"), ("Paloma", "she"), ("Nikolai", "he"), ("Wren", "she"), ("Anton", "he"),
    ("Tamsin", "she"), ("Raj", "he"), ("Ilse", "she"), ("Sefa", "he"), ("Joanna", "she"), ("Malik", "he"),
]
_FOREIGN_NAMES = [
    ("Zebulon", "he"), ("Philippa", "she"), ("Thaddeus", "he"), ("Ottoline", "she"), ("Barnaby", "he"),
    ("Winifred", "she"), ("Ezekiel", "he"), ("Cordelia", "she"), ("Lysander", "he"), ("Henrietta", "she"),
    ("Montgomery", "he"), ("Rosalind", "she"), ("Archibald", "he"), ("Marguerite", "she"), ("Cornelius", "he"),
    ("Temperance", "she"), ("Ignatius", "he"), ("Gwendolyn", "she"), ("Percival", "he"), ("Seraphina", "she"),
]

_PRONOUNS = {"she": ("she", "her", "her"), "he": ("he", "him", "his")}

_LIB = {
    # (container singular, container plural), loose goods that fit in it
    "containers": [("crate", "crates"), ("box", "boxes"), ("basket", "baskets"), ("sack", "sacks"),
                   ("carton", "cartons"), ("barrel", "barrels"), ("tin", "tins"), ("bucket", "buckets")],
    "goods": ["apples", "oranges", "pears", "lemons", "potatoes", "onions", "eggs", "marbles", "pencils",
              "candles", "buttons", "walnuts", "tomatoes", "peaches", "plums", "corks"],
    "jobs": [("café", "barista"), ("library", "clerk"), ("garage", "mechanic"), ("bakery", "baker"),
             ("farm", "farmhand"), ("cinema", "usher"), ("hotel", "receptionist"), ("warehouse", "packer"),
             ("museum", "guide"), ("pharmacy", "assistant")],
    "purchases": ["a bicycle", "a winter coat", "a guitar", "a pair of boots", "a tent", "a camera",
                  "a desk lamp", "a backpack", "a violin bow", "a sewing machine"],
    "bakes": [("muffin", "muffins"), ("cookie", "cookies"), ("scone", "scones"), ("cupcake", "cupcakes"),
              ("brownie", "brownies"), ("pretzel", "pretzels"), ("croissant", "croissants"), ("bagel", "bagels")],
    "vehicles": ["truck", "train", "bus", "ferry", "van", "motorbike", "tractor", "coach"],
    "shops": ["market", "hardware store", "stationery shop", "toy shop", "garden centre", "book shop",
              "corner shop", "craft fair"],
    "items": [("notebook", "notebooks"), ("paintbrush", "paintbrushes"), ("flowerpot", "flowerpots"),
              ("light bulb", "light bulbs"), ("puzzle", "puzzles"), ("candle", "candles"), ("mug", "mugs"),
              ("towel", "towels"), ("kite", "kites"), ("hammer", "hammers"), ("scarf", "scarves"),
              ("sketchbook", "sketchbooks")],
    "plants": ["tulips", "carrots", "lettuces", "sunflowers", "rose bushes", "cabbages", "bean plants",
               "strawberry plants", "pepper plants", "lavender plants"],
    "books": ["a mystery novel", "a history book", "a cookbook", "a biography", "a science textbook",
              "an atlas", "a fantasy saga", "a poetry collection"],
    "collections": ["stamps", "coins", "stickers", "seashells", "trading cards", "postcards", "badges",
                    "keychains"],
    "factories": [("toy factory", "wooden trains"), ("bottling plant", "bottles"), ("print shop", "posters"),
                  ("shoe factory", "sandals"), ("bakery line", "loaves"), ("workshop", "chairs"),
                  ("brick works", "bricks"), ("candy factory", "lollipops")],
    "venues": ["zoo", "science museum", "aquarium", "planetarium", "theme park", "art gallery", "castle",
               "botanical garden"],
    "tanks": ["water tank", "rain barrel", "fish pond", "swimming pool", "cistern", "reservoir tank"],
    "fluids": ["water", "rainwater", "well water"],
}
# Same keys, disjoint words: used only by unrelated_questions.
_FOREIGN = {
    "containers": [("trunk", "trunks"), ("chest", "chests"), ("hamper", "hampers"), ("satchel", "satchels")],
    "goods": ["seashells", "doubloons", "meteorites", "feathers", "acorns", "thimbles", "dice", "quills"],
    "jobs": [("lighthouse", "keeper"), ("observatory", "astronomer"), ("circus", "juggler"),
             ("vineyard", "picker")],
    "purchases": ["a telescope", "a harpsichord", "a kayak", "a saddle"],
    "bakes": [("pie", "pies"), ("tart", "tarts"), ("dumpling", "dumplings"), ("waffle", "waffles")],
    "vehicles": ["airship", "hovercraft", "gondola", "rickshaw"],
    "shops": ["antique shop", "apothecary", "bazaar", "flea market"],
    "items": [("lantern", "lanterns"), ("compass", "compasses"), ("hourglass", "hourglasses"),
              ("telescope", "telescopes")],
    "plants": ["orchids", "cacti", "bonsai trees", "ferns"],
    "books": ["an almanac", "a star chart", "a sea chart", "a grimoire"],
    "collections": ["fossils", "arrowheads", "pressed flowers", "beetles"],
    "factories": [("forge", "horseshoes"), ("glassworks", "vases"), ("mint", "medals"), ("loom house", "rugs")],
    "venues": ["opera house", "observatory", "lighthouse", "ice rink"],
    "tanks": ["aquarium tank", "moat", "fountain"],
    "fluids": ["seawater", "spring water"],
}


class _Ctx:
    """Rendering helpers for one problem: name, pronouns and the rng that picks wording."""

    __slots__ = ("p", "rng", "S", "O", "P", "N")

    def __init__(self, params: dict, rng: random.Random):
        self.p = params
        self.rng = rng
        self.N = params["name"]
        self.S, self.O, self.P = _PRONOUNS[params["pronoun"]]

    def pick(self, options: list[str]) -> str:
        return self.rng.choice(options).format(N=self.N, S=self.S, O=self.O, P=self.P, **self.p)


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _join(sentences: list[str]) -> str:
    return " ".join(_cap(s.strip()) for s in sentences)


# Each family: params(rng, vocab) -> dict; solve(params) -> (equations, answer, unit phrase);
# render(params, rng) -> text. Equations are (left expression, result, why) and become the steps.


def _f_crates_params(rng: random.Random, v: dict) -> dict:
    cont = rng.choice(v["containers"])
    a = rng.randint(6, 40)
    b = rng.randint(2, 15)
    c = rng.randint(2, a + b - 2)
    return {
        "cs": cont[0], "cp": cont[1], "goods": rng.choice(v["goods"]), "a": a, "b": b, "c": c,
        "d": rng.randint(4, 30), "e": rng.randint(3, 25) if rng.random() < 0.4 else 0,
    }


def _f_crates_solve(p: dict) -> tuple[list[tuple[str, int, str]], int]:
    s1 = p["a"] + p["b"]
    s2 = s1 - p["c"]
    s3 = s2 * p["d"]
    eqs = [
        (f"{p['a']} + {p['b']}", s1, f"{p['name']} starts with {p['a']} {p['cp']} and buys {p['b']} more"),
        (f"{s1} - {p['c']}", s2, f"after giving away {p['c']} {p['cp']}, {s2} {p['cp']} are left"),
        (f"{s2} * {p['d']}", s3, f"each {p['cs']} holds {p['d']} {p['goods']}"),
    ]
    if p["e"]:
        eqs.append((f"{s3} + {p['e']}", s3 + p["e"], f"adding the {p['e']} loose {p['goods']}"))
    return eqs, eqs[-1][1]


def _f_crates_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    have = c.pick(["{N} has {a} {cp} of {goods}.", "{N} owns {a} {cp} of {goods}.",
                   "{N} keeps {a} {cp} of {goods} in a shed."])
    trade = c.pick(["{S} buys {b} more {cp}, then gives away {c}.",
                    "{S} purchases another {b} {cp} and later gives {c} of them away.",
                    "After buying {b} more {cp}, {S} donates {c} {cp} to a neighbour."])
    hold = c.pick(["Each {cs} holds {d} {goods}.", "Every {cs} contains {d} {goods}.",
                   "There are {d} {goods} in each {cs}."])
    loose = c.pick(["{S} also has {e} loose {goods}.", "On top of that, {S} has {e} {goods} that are not in any {cs}."]) if p["e"] else ""
    q = c.pick(["How many {goods} does {S} have now?", "How many {goods} does {N} have in total now?",
                "What is the total number of {goods} {N} has now?", "Find the number of {goods} {N} ends up with."])
    order = rng.choice([[have, trade, hold, loose], [hold, have, trade, loose], [have, loose, trade, hold]])
    return _join([s for s in order if s] + [q])


def _f_wages_params(rng: random.Random, v: dict) -> dict:
    place, job = rng.choice(v["jobs"])
    h = rng.randint(3, 9)
    d = rng.randint(3, 12)
    r = rng.randint(8, 25)
    earned = h * d * r
    return {"place": place, "job": job, "h": h, "d": d, "r": r, "item": rng.choice(v["purchases"]),
            "s": rng.randint(earned // 5, earned - 10), "bonus": rng.choice([0, 0, 25, 40, 50, 75, 100])}


def _f_wages_solve(p: dict):
    hours = p["h"] * p["d"]
    earned = hours * p["r"]
    eqs = [(f"{p['h']} * {p['d']}", hours, f"{p['name']} works {p['h']} hours a day for {p['d']} days"),
           (f"{hours} * {p['r']}", earned, f"at ${p['r']} per hour the pay is {earned} dollars")]
    total = earned
    if p["bonus"]:
        total = earned + p["bonus"]
        eqs.append((f"{earned} + {p['bonus']}", total, f"the ${p['bonus']} bonus is added"))
    eqs.append((f"{total} - {p['s']}", total - p["s"], f"{p['item']} costs ${p['s']}"))
    return eqs, eqs[-1][1]


def _f_wages_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    work = c.pick(["{N} works as a {job} at the {place} for {h} hours a day, {d} days in a row.",
                   "{N} has a job as a {job} at a {place}, working {h} hours each day for {d} days.",
                   "For {d} days, {N} works {h} hours a day as a {job} at the {place}."])
    pay = c.pick(["The {place} pays ${r} per hour.", "{S} earns ${r} for every hour worked.",
                  "The hourly wage is ${r}."])
    bonus = c.pick(["At the end {S} also receives a ${bonus} bonus.", "{S} is given an extra ${bonus} as a bonus."]) if p["bonus"] else ""
    spend = c.pick(["Then {S} spends ${s} on {item}.", "{S} uses ${s} of the money to buy {item}.",
                    "Afterwards {S} buys {item} for ${s}."])
    q = c.pick(["How many dollars does {S} have left?", "How much money does {N} have left?",
                "How much of the money remains after the purchase?", "What amount, in dollars, does {N} still have?"])
    order = rng.choice([[work, pay, bonus, spend], [pay, work, bonus, spend], [work, pay, spend, bonus]])
    return _join([s for s in order if s] + [q])


def _f_share_params(rng: random.Random, v: dict) -> dict:
    bs, bp = rng.choice(v["bakes"])
    for _ in range(100):
        a = rng.randint(2, 8)
        b = rng.randint(6, 24)
        d = rng.randint(3, 9)
        total = a * b
        q = rng.randint(max(1, (2 * total) // (3 * d)), max(1, (total - 1) // d))
        c = total - d * q
        if 1 <= c <= total // 2:
            return {"bs": bs, "bp": bp, "a": a, "b": b, "c": c, "d": d}
    return {"bs": bs, "bp": bp, "a": 4, "b": 12, "c": 3, "d": 5}


def _f_share_solve(p: dict):
    total = p["a"] * p["b"]
    rest = total - p["c"]
    each = rest // p["d"]
    eqs = [(f"{p['a']} * {p['b']}", total, f"{p['a']} trays with {p['b']} {p['bp']} each"),
           (f"{total} - {p['c']}", rest, f"{p['name']} keeps {p['c']} {p['bp']}"),
           (f"{rest} / {p['d']}", each, f"the rest is shared equally among {p['d']} friends")]
    return eqs, each


def _f_share_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    bake = c.pick(["{N} bakes {a} trays of {bp} with {b} {bp} on each tray.",
                   "{N} makes {a} trays of {bp}; every tray has {b} {bp}.",
                   "There are {b} {bp} on each of the {a} trays {N} bakes."])
    keep = c.pick(["{S} keeps {c} {bp} for {O}self.", "{S} eats {c} of them.", "{S} sets aside {c} {bp} for the family."])
    share = c.pick(["{S} shares the rest equally among {d} friends.",
                    "The remaining {bp} are divided equally between {d} friends.",
                    "Then {S} splits what is left evenly among {d} friends."])
    q = c.pick(["How many {bp} does each friend get?", "How many {bp} does every friend receive?",
                "What is each friend's share of {bp}?"])
    order = rng.choice([[bake, keep, share], [bake, share, keep]])
    if order[1] is share:  # the split is stated before the kept ones, so say the keeping happens first
        order[2] = c.pick(["Before sharing, {S} keeps {c} {bp}.", "But first {S} eats {c} of them."])
    return _join(order + [q])


def _f_travel_params(rng: random.Random, v: dict) -> dict:
    return {"veh": rng.choice(v["vehicles"]), "v": rng.randint(30, 95), "t": rng.randint(2, 9),
            "u": rng.randint(10, 120), "twice": rng.random() < 0.5}


def _f_travel_solve(p: dict):
    d1 = p["v"] * p["t"]
    eqs = [(f"{p['v']} * {p['t']}", d1, f"{p['t']} hours at {p['v']} km per hour"),
           (f"{d1} + {p['u']}", d1 + p["u"], f"then {p['u']} km more")]
    if p["twice"]:
        eqs.append((f"{d1 + p['u']} * 2", (d1 + p["u"]) * 2, "the same trip is made twice"))
    return eqs, eqs[-1][1]


def _f_travel_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    drive = c.pick(["{N} drives a {veh} at {v} km per hour for {t} hours.",
                    "For {t} hours, {N}'s {veh} travels at {v} kilometres per hour.",
                    "{N} takes the {veh} and goes {v} km each hour for {t} hours."])
    more = c.pick(["Then {S} covers another {u} km.", "After that the {veh} goes a further {u} km.",
                   "{S} then drives {u} more kilometres."])
    twice = c.pick(["The next day {S} makes exactly the same trip again.", "{S} repeats the whole journey the following day."]) if p["twice"] else ""
    q = c.pick(["How many kilometres does {S} travel in total?", "What is the total distance {N} covers, in km?",
                "How far does the {veh} go altogether?"])
    return _join([s for s in [drive, more, twice] if s] + [q])


def _f_shop_params(rng: random.Random, v: dict) -> dict:
    i1, i2 = rng.sample(v["items"], 2)
    q1, p1 = rng.randint(2, 9), rng.randint(2, 18)
    q2, p2 = rng.randint(2, 9), rng.randint(2, 18)
    cost = q1 * p1 + q2 * p2
    m = next(x for x in (20, 50, 100, 200, 500) if x > cost)
    return {"shop": rng.choice(v["shops"]), "i1s": i1[0], "i1p": i1[1], "i2s": i2[0], "i2p": i2[1],
            "q1": q1, "p1": p1, "q2": q2, "p2": p2, "m": m}


def _f_shop_solve(p: dict):
    c1 = p["q1"] * p["p1"]
    c2 = p["q2"] * p["p2"]
    tot = c1 + c2
    eqs = [(f"{p['q1']} * {p['p1']}", c1, f"{p['q1']} {p['i1p']} at ${p['p1']} each"),
           (f"{p['q2']} * {p['p2']}", c2, f"{p['q2']} {p['i2p']} at ${p['p2']} each"),
           (f"{c1} + {c2}", tot, "the total cost"),
           (f"{p['m']} - {tot}", p["m"] - tot, f"change from ${p['m']}")]
    return eqs, eqs[-1][1]


def _f_shop_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    buy = c.pick(["At the {shop}, {N} buys {q1} {i1p} at ${p1} each and {q2} {i2p} at ${p2} each.",
                  "{N} goes to the {shop} and picks up {q1} {i1p} costing ${p1} apiece, plus {q2} {i2p} costing ${p2} apiece.",
                  "{N} purchases {q1} {i1p} (${p1} each) and {q2} {i2p} (${p2} each) at the {shop}."])
    pay = c.pick(["{S} pays with a ${m} bill.", "{S} hands the cashier ${m}.", "{S} gives ${m} to pay for everything."])
    q = c.pick(["How much change does {S} get back?", "How many dollars of change does {N} receive?",
                "What is {N}'s change, in dollars?"])
    return _join([buy, pay, q])


def _f_garden_params(rng: random.Random, v: dict) -> dict:
    r, n = rng.randint(3, 15), rng.randint(4, 20)
    return {"plant": rng.choice(v["plants"]), "r": r, "n": n, "dead": rng.randint(1, r * n // 3),
            "add": rng.randint(2, 30)}


def _f_garden_solve(p: dict):
    tot = p["r"] * p["n"]
    alive = tot - p["dead"]
    eqs = [(f"{p['r']} * {p['n']}", tot, f"{p['r']} rows of {p['n']} {p['plant']}"),
           (f"{tot} - {p['dead']}", alive, f"{p['dead']} of them die"),
           (f"{alive} + {p['add']}", alive + p["add"], f"{p['add']} new ones are planted")]
    return eqs, eqs[-1][1]


def _f_garden_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    plant = c.pick(["{N} plants {r} rows of {plant} with {n} in each row.",
                    "In {P} garden, {N} puts in {r} rows of {plant}, {n} per row.",
                    "{N}'s garden has {r} rows of {plant}, and each row holds {n} of them."])
    die = c.pick(["A frost kills {dead} of them.", "{dead} of the {plant} die during a dry spell.",
                  "Sadly, {dead} {plant} do not survive."])
    add = c.pick(["{S} then plants {add} more.", "Later {S} adds {add} new {plant}.", "Afterwards {N} plants another {add}."])
    q = c.pick(["How many {plant} are in the garden now?", "How many {plant} does {N} have growing now?",
                "What is the number of {plant} in the garden at the end?"])
    return _join([plant, die, add, q])


def _f_reading_params(rng: random.Random, v: dict) -> dict:
    pp, d = rng.randint(8, 45), rng.randint(3, 12)
    e = rng.randint(10, 60) if rng.random() < 0.5 else 0
    return {"book": rng.choice(v["books"]), "pp": pp, "d": d, "e": e, "T": pp * d + e + rng.randint(15, 200)}


def _f_reading_solve(p: dict):
    read = p["pp"] * p["d"]
    eqs = [(f"{p['pp']} * {p['d']}", read, f"{p['pp']} pages a day for {p['d']} days")]
    if p["e"]:
        eqs.append((f"{read} + {p['e']}", read + p["e"], f"plus the {p['e']} pages read before"))
    done = eqs[-1][1]
    eqs.append((f"{p['T']} - {done}", p["T"] - done, f"the book has {p['T']} pages"))
    return eqs, eqs[-1][1]


def _f_reading_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    book = c.pick(["{N} is reading {book} that has {T} pages.", "{N} borrows {book} with {T} pages.",
                   "The {T}-page book {N} is reading is {book}."])
    before = c.pick(["{S} has already read {e} pages.", "Before this week {S} read {e} pages of it."]) if p["e"] else ""
    pace = c.pick(["{S} reads {pp} pages a day for {d} days.", "For {d} days {S} reads {pp} pages each day.",
                   "Every day for {d} days, {N} gets through {pp} pages."])
    q = c.pick(["How many pages are left to read?", "How many pages does {N} still have to read?",
                "How many pages of the book remain unread?"])
    order = rng.choice([[book, before, pace], [book, pace, before]])
    return _join([s for s in order if s] + [q])


def _f_collect_params(rng: random.Random, v: dict) -> dict:
    a, b, w = rng.randint(10, 90), rng.randint(2, 12), rng.randint(3, 10)
    return {"coll": rng.choice(v["collections"]), "a": a, "b": b, "w": w, "c": rng.randint(2, (a + b * w) // 2),
            "who": rng.choice(["a cousin", "a friend", "a younger brother", "a classmate", "a neighbour"])}


def _f_collect_solve(p: dict):
    got = p["b"] * p["w"]
    tot = p["a"] + got
    eqs = [(f"{p['b']} * {p['w']}", got, f"{p['b']} new {p['coll']} a week for {p['w']} weeks"),
           (f"{p['a']} + {got}", tot, f"added to the {p['a']} at the start"),
           (f"{tot} - {p['c']}", tot - p["c"], f"{p['c']} are given to {p['who']}")]
    return eqs, eqs[-1][1]


def _f_collect_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    start = c.pick(["{N} collects {coll} and has {a} of them.", "{N}'s collection has {a} {coll}.",
                    "{N} starts with {a} {coll} in an album."])
    grow = c.pick(["Each week {S} adds {b} more for {w} weeks.", "For {w} weeks {S} gets {b} new {coll} every week.",
                   "Over the next {w} weeks, {N} collects {b} {coll} a week."])
    give = c.pick(["Then {S} gives {c} {coll} to {who}.", "{S} later hands {c} of them to {who}.",
                   "At the end {N} gives {who} {c} {coll}."])
    q = c.pick(["How many {coll} does {N} have now?", "How many {coll} are in {P} collection at the end?",
                "What is the final number of {coll} {N} owns?"])
    return _join([start, grow, give, q])


def _f_factory_params(rng: random.Random, v: dict) -> dict:
    fac, prod = rng.choice(v["factories"])
    a, h, d = rng.randint(12, 90), rng.randint(4, 10), rng.randint(2, 7)
    return {"fac": fac, "prod": prod, "a": a, "h": h, "d": d, "k": rng.randint(3, a * h * d // 10)}


def _f_factory_solve(p: dict):
    day = p["a"] * p["h"]
    tot = day * p["d"]
    eqs = [(f"{p['a']} * {p['h']}", day, f"{p['a']} {p['prod']} an hour for {p['h']} hours"),
           (f"{day} * {p['d']}", tot, f"for {p['d']} days"),
           (f"{tot} - {p['k']}", tot - p["k"], f"{p['k']} are defective")]
    return eqs, eqs[-1][1]


def _f_factory_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    mach = c.pick(["A machine at {N}'s {fac} makes {a} {prod} per hour.",
                   "{N} runs a machine in a {fac} that produces {a} {prod} every hour.",
                   "At the {fac} where {N} works, one machine turns out {a} {prod} an hour."])
    run = c.pick(["It runs {h} hours a day for {d} days.", "The machine works {h} hours each day for {d} days.",
                  "For {d} days it operates {h} hours daily."])
    bad = c.pick(["{k} of the {prod} are defective and thrown away.", "Inspection rejects {k} {prod}.",
                  "Of these, {k} turn out to be faulty."])
    q = c.pick(["How many good {prod} are made?", "How many {prod} pass inspection?",
                "How many usable {prod} does the machine produce?"])
    return _join([mach, run, bad, q])


def _f_tickets_params(rng: random.Random, v: dict) -> dict:
    s, g = rng.randint(12, 40), rng.randint(2, 6)
    t, u = rng.randint(4, 15), rng.randint(10, 30)
    disc = rng.choice([0, 0, 10, 15, 20, 25])
    return {"venue": rng.choice(v["venues"]), "s": s, "g": g, "t": t, "u": u, "disc": disc}


def _f_tickets_solve(p: dict):
    c1, c2 = p["s"] * p["t"], p["g"] * p["u"]
    eqs = [(f"{p['s']} * {p['t']}", c1, f"{p['s']} student tickets at ${p['t']}"),
           (f"{p['g']} * {p['u']}", c2, f"{p['g']} adult tickets at ${p['u']}"),
           (f"{c1} + {c2}", c1 + c2, "the total before any discount")]
    if p["disc"]:
        eqs.append((f"{c1 + c2} - {p['disc']}", c1 + c2 - p["disc"], f"the ${p['disc']} group discount"))
    return eqs, eqs[-1][1]


def _f_tickets_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    group = c.pick(["{N} takes {s} students and {g} adults to the {venue}.",
                    "A class of {s} students visits the {venue} with {g} adults, on a trip {N} organises.",
                    "{N} organises a trip to the {venue} for {s} students and {g} adults."])
    price = c.pick(["Student tickets cost ${t} and adult tickets cost ${u}.",
                    "A ticket is ${t} for a student and ${u} for an adult.",
                    "Each student pays ${t}, each adult ${u}."])
    disc = c.pick(["The {venue} takes ${disc} off the total as a group discount.",
                   "A group discount of ${disc} is applied to the whole bill."]) if p["disc"] else ""
    q = c.pick(["How much does the trip cost in total?", "What is the total ticket cost, in dollars?",
                "How many dollars does {N} pay for all the tickets?"])
    return _join([s for s in [group, price, disc] if s] + [q])


def _f_tank_params(rng: random.Random, v: dict) -> dict:
    x, y, m = rng.randint(20, 300), rng.randint(5, 40), rng.randint(3, 20)
    return {"tank": rng.choice(v["tanks"]), "fluid": rng.choice(v["fluids"]), "x": x, "y": y, "m": m,
            "C": x + y * m + rng.randint(10, 400)}


def _f_tank_solve(p: dict):
    added = p["y"] * p["m"]
    now = p["x"] + added
    eqs = [(f"{p['y']} * {p['m']}", added, f"{p['y']} litres a minute for {p['m']} minutes"),
           (f"{p['x']} + {added}", now, f"added to the {p['x']} litres already there"),
           (f"{p['C']} - {now}", p["C"] - now, f"the capacity is {p['C']} litres")]
    return eqs, eqs[-1][1]


def _f_tank_render(p: dict, rng: random.Random) -> str:
    c = _Ctx(p, rng)
    cap = c.pick(["{N}'s {tank} holds {C} litres.", "The {tank} that {N} looks after can hold {C} litres of {fluid}.",
                  "A {tank} owned by {N} has a capacity of {C} litres."])
    now = c.pick(["It already contains {x} litres of {fluid}.", "Right now there are {x} litres in it.",
                  "It starts with {x} litres of {fluid}."])
    pump = c.pick(["{N} pumps in {y} litres per minute for {m} minutes.",
                   "A pump adds {y} litres each minute for {m} minutes.",
                   "For {m} minutes, {y} litres of {fluid} flow in every minute."])
    q = c.pick(["How many more litres are needed to fill it?", "How many litres short of full is the {tank}?",
                "How much more {fluid}, in litres, would fill the {tank} to the top?"])
    if rng.random() < 0.5:
        return _join([cap, now, pump, q])
    # Capacity last: the tank is named in the first sentence instead, and "it" refers back to it.
    now = c.pick(["{N}'s {tank} contains {x} litres of {fluid}.", "There are {x} litres in {N}'s {tank}."])
    cap = c.pick(["When full, it holds {C} litres.", "Its capacity is {C} litres."])
    return _join([now, pump, cap, q])


@dataclass(slots=True, frozen=True)
class _Family:
    name: str
    params: Callable[[random.Random, dict], dict]
    solve: Callable[[dict], tuple[list[tuple[str, int, str]], int]]
    render: Callable[[dict, random.Random], str]
    main: str  # the params key naming the main object; (family, name, main object) is kept distinct


_FAMILIES = [
    _Family("crates", _f_crates_params, _f_crates_solve, _f_crates_render, "goods"),
    _Family("wages", _f_wages_params, _f_wages_solve, _f_wages_render, "item"),
    _Family("share", _f_share_params, _f_share_solve, _f_share_render, "bp"),
    _Family("travel", _f_travel_params, _f_travel_solve, _f_travel_render, "veh"),
    _Family("shop", _f_shop_params, _f_shop_solve, _f_shop_render, "i1p"),
    _Family("garden", _f_garden_params, _f_garden_solve, _f_garden_render, "plant"),
    _Family("reading", _f_reading_params, _f_reading_solve, _f_reading_render, "book"),
    _Family("collect", _f_collect_params, _f_collect_solve, _f_collect_render, "coll"),
    _Family("factory", _f_factory_params, _f_factory_solve, _f_factory_render, "prod"),
    _Family("tickets", _f_tickets_params, _f_tickets_solve, _f_tickets_render, "venue"),
    _Family("tank", _f_tank_params, _f_tank_solve, _f_tank_render, "tank"),
]
_FAMILY_BY_NAME = {f.name: f for f in _FAMILIES}


def _steps(fam: _Family, params: dict) -> tuple[list[str], int]:
    eqs, answer = fam.solve(params)
    steps = [f"Step {i}: {_cap(why)}: {expr} = {val}." for i, (expr, val, why) in enumerate(eqs, 1)]
    steps.append(f"The answer is {answer}.")
    return steps, answer


def _make(fam: _Family, params: dict, rng: random.Random, pid: str) -> Problem:
    steps, answer = _steps(fam, params)
    return Problem(id=pid, text=fam.render(params, rng), answer=answer, steps=steps, rewordings=[],
                   family=fam.name, params=params)


def _rng(*parts: object) -> random.Random:
    # A string seed is hashed by random.seed with SHA-512, stable across processes (unlike hash()).
    return random.Random("/".join(str(p) for p in parts))


def generate_problems(n: int, seed: int, *, rewordings: int = 3) -> list[Problem]:
    """`n` distinct multi-step word problems, the same for the same (n, seed); each with `rewordings`."""
    if n < 0:
        raise InvalidInput(f"n must be >= 0, got {n}")
    rng = _rng("problems", seed)
    out: list[Problem] = []
    seen_text: set[str] = set()
    seen_combo: set[tuple[str, str, str]] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        fam = _FAMILIES[len(out) % len(_FAMILIES)] if attempts < 50 * (n + 10) else rng.choice(_FAMILIES)
        name, pronoun = rng.choice(_LIB_NAMES)
        params = fam.params(rng, _LIB)
        params["name"], params["pronoun"] = name, pronoun
        combo = (fam.name, name, str(params[fam.main]))
        # Distinct surface content: a (family, person, main object) triple is used once while there are
        # unused ones left; only a very large n falls back to distinct text alone.
        if combo in seen_combo and attempts < 20 * (n + 10):
            continue
        p = _make(fam, params, _rng("render", seed, len(out)), f"s{seed}-{len(out):05d}")
        if p.text in seen_text:
            continue
        seen_text.add(p.text)
        seen_combo.add(combo)
        out.append(p)
    if rewordings:
        out = [Problem(id=p.id, text=p.text, answer=p.answer, steps=p.steps,
                       rewordings=reword(p, seed, n=rewordings), family=p.family, params=p.params)
               for p in out]
    return out


def reword(problem: Problem, seed: int, *, n: int = 3) -> list[str]:
    """Up to `n` paraphrases of `problem`: same numbers and meaning, other wording / sentence order.

    Deterministic per (problem, seed). Every paraphrase differs from the original and from the others.
    """
    fam = _FAMILY_BY_NAME.get(problem.family)
    if fam is None:
        raise InvalidInput(f"problem {problem.id!r} has no known family; only generated problems can be reworded")
    out: list[str] = []
    seen = {problem.text}
    for i in range(40 * max(n, 1)):
        if len(out) >= n:
            break
        text = fam.render(problem.params, _rng("reword", seed, problem.id, problem.text, i))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


# ---------------------------------------------------------------------------------------------------
# Unrelated questions
# ---------------------------------------------------------------------------------------------------

_COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "Peru", "Vietnam", "Egypt", "Australia",
              "Mexico", "Poland", "Chile", "Ghana", "Thailand", "Portugal", "Mongolia", "Finland", "Morocco", "Nepal"]
_TOPICS = ["black holes", "the French Revolution", "photosynthesis", "plate tectonics", "the Roman Empire",
           "vaccines", "climate change", "the printing press", "quantum entanglement", "the immune system",
           "volcanoes", "the Silk Road", "jazz music", "impressionist painting", "DNA replication", "tides",
           "the stock market", "bird migration", "the Renaissance", "nuclear fusion"]
_GENERAL = [
    "What is the capital of {country}?", "What language is mainly spoken in {country}?",
    "What is the currency of {country}?", "Can you explain {topic} in simple terms?",
    "Who are the most important people in the history of {topic}?", "Why is {topic} important?",
    "Give me a short summary of {topic}.", "What is a common misconception about {topic}?",
    "Why is the sky blue?", "How far away is the Moon from the Earth?", "Who painted the Mona Lisa?",
    "What is the tallest mountain in the world?", "How do airplanes stay in the air?",
    "What causes the seasons on Earth?", "Who wrote Pride and Prejudice?", "What is the speed of light?",
]
_CHITCHAT = [
    "Hi there, how are you doing today?", "Good morning! Did you sleep well?", "Tell me a joke about {animal}.",
    "What's your favourite colour?", "Can you recommend a good movie for tonight?", "I'm feeling a bit bored, any ideas?",
    "Do you like {animal}?", "What should I cook for dinner tonight?", "Thanks for your help earlier!",
    "What is a fun weekend activity in the rain?", "Write a short poem about {animal}.",
    "Which is cuter, a {animal} or a kitten?", "Can you suggest names for my two new {animal}?",
]
_ANIMALS = ["penguins", "otters", "cats", "dogs", "owls", "giraffes", "hedgehogs", "dolphins", "foxes", "koalas"]
_CODING = [
    "How do I reverse a list in Python?", "Write a SQL query that counts orders per {thing}.",
    "What does git rebase do?", "Explain the difference between a process and a thread.",
    "How do I parse JSON in {lang}?", "What is a closure in {lang}?", "How do I read a file line by line in {lang}?",
    "Why does my {lang} program crash with a null pointer error?", "What is the time complexity of quicksort?",
    "How do I set up a virtual environment for a Python project?", "What is the difference between TCP and UDP?",
    "How do I center a div with CSS?", "Write a regular expression that matches an email address.",
    "How do I sort a dictionary by value in {lang}?", "What is dependency injection?",
]
_LANGS = ["Python", "JavaScript", "Rust", "Go", "Java", "C++", "Kotlin", "Ruby"]
_THINGS = ["customer", "region", "month", "product", "supplier"]
_OTHER = [
    "How do I make sourdough bread at home?", "What are the symptoms of the flu?",
    "How do I translate 'good morning' into {language}?", "What is the best way to learn {language}?",
    "How should I train for a half marathon?", "How often should I water a {houseplant}?",
    "What are the rules of cricket?", "How do I change a flat tyre?", "What is a good stretching routine?",
    "How do I remove a red wine stain from a carpet?", "Is it better to rent or to buy a house?",
]
_LANGUAGES = ["French", "German", "Japanese", "Spanish", "Italian", "Swahili", "Korean", "Portuguese"]
_HOUSEPLANTS = ["monstera", "snake plant", "peace lily", "fiddle leaf fig", "pothos"]


def _novel_arithmetic(rng: random.Random) -> str:
    """Arithmetic whose structure is not one of the library families (conversions, geometry, percent...)."""
    a, b = rng.randint(12, 999), rng.randint(3, 99)
    name = rng.choice(_FOREIGN_NAMES)[0]
    return rng.choice([
        f"What is {a} times {b}?", f"What is {a} plus {b} minus {b // 2}?",
        f"How many seconds are there in {b} hours?", f"How many minutes are in {b} days?",
        f"A rectangle is {b} metres wide and {a} metres long. What is its area?",
        f"What is {b}% of {a * 4}?", f"Convert {b} degrees Celsius to Fahrenheit.",
        f"The perimeter of a square is {4 * b} cm. How long is one side?",
        f"{name} is {b % 40 + 5} years old and {_poss(name)} grandmother is three times as old. How old is the grandmother?",
        f"If a recipe for {b % 6 + 2} people needs {a} grams of flour, how much flour is needed for {b % 6 + 6} people?",
        f"A loan of {a * 100} dollars earns {b % 9 + 1}% simple interest a year. How much interest after {b % 5 + 2} years?",
        f"What is the average of {a}, {b} and {a + b}?", f"Is {a * b + 1} a prime number?",
        f"Round {a}.{b} to the nearest whole number.", f"What is {a * b} divided by {b}?",
    ])


def _poss(name: str) -> str:
    return "his" if dict(_FOREIGN_NAMES)[name] == "he" else "her"


def _foreign_family_problem(rng: random.Random) -> str:
    """A library-shaped problem about people and things that never appear in generated problems."""
    fam = rng.choice(_FAMILIES)
    params = fam.params(rng, _FOREIGN)
    params["name"], params["pronoun"] = rng.choice(_FOREIGN_NAMES)
    return fam.render(params, rng)


def unrelated_questions(n: int, seed: int) -> list[str]:
    """`n` distinct questions that must route to nothing when the library holds `generate_problems` output.

    Mix: general knowledge, chit-chat, coding, other everyday domains, arithmetic with structures the
    library does not have, and library-shaped arithmetic about entities the library never uses.
    """
    if n < 0:
        raise InvalidInput(f"n must be >= 0, got {n}")
    rng = _rng("unrelated", seed)
    kinds = ["general", "chitchat", "coding", "other", "novel_arith", "foreign_arith"]
    out: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n and attempts < 200 * (n + 10):
        attempts += 1
        kind = kinds[len(out) % len(kinds)] if attempts < 20 * (n + 10) else rng.choice(kinds)
        if kind == "general":
            q = rng.choice(_GENERAL).format(country=rng.choice(_COUNTRIES), topic=rng.choice(_TOPICS))
        elif kind == "chitchat":
            q = rng.choice(_CHITCHAT).format(animal=rng.choice(_ANIMALS))
        elif kind == "coding":
            q = rng.choice(_CODING).format(lang=rng.choice(_LANGS), thing=rng.choice(_THINGS))
        elif kind == "other":
            q = rng.choice(_OTHER).format(language=rng.choice(_LANGUAGES), houseplant=rng.choice(_HOUSEPLANTS))
        elif kind == "novel_arith":
            q = _novel_arithmetic(rng)
        else:
            q = _foreign_family_problem(rng)
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out
