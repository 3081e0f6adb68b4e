"""Offline toy tools for the agent benchmark (`bench/agents.py`): plain functions with type hints and
docstrings, which LangChain's `@tool` and LlamaIndex's `FunctionTool.from_defaults` turn into real tools.

Every tool is deterministic and needs no network: small tables stand in for a weather service, a
clock, exchange rates and so on, and a name a table does not hold gets a value derived from the name
itself (so any argument the model writes gets an answer, as a real service would give one). What is
measured is the agent loop (does it call a tool, stop after the result, and say it), not the tools.
"""

from __future__ import annotations

import ast
import operator
import re
import zlib
from collections.abc import Callable

# A fixed clock, so `get_time` answers the same on every run: 12:00 UTC.
_UTC_HOUR = 12


def _seeded(text: str, lo: int, hi: int) -> int:
    """A stable integer in [lo, hi] derived from `text` (crc32: the same on every machine and run)."""
    return lo + zlib.crc32(text.strip().lower().encode()) % (hi - lo + 1)


def _key(text: str) -> str:
    return re.sub(r"[^a-z]", "", text.lower())


# ---------------------------------------------------------------------- weather
_WEATHER = {"paris": (18, "cloudy"), "tokyo": (23, "light rain"), "cairo": (34, "sunny"),
            "berlin": (14, "windy"), "rome": (26, "sunny"), "london": (12, "overcast")}


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    temp, sky = _WEATHER.get(_key(city), (_seeded(city, 5, 30), "clear"))
    return f"{temp} °C, {sky}"


# ---------------------------------------------------------------------- calculator
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / ** ( ) are allowed")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. 12 * (3 + 4)."""
    # Spellings people write: "x" / "times" for *, "15% of 240" for 15/100*240.
    text = expression.lower().replace("×", "*").replace("÷", "/")
    text = re.sub(r"\b(x|times|multiplied by)\b", "*", text)
    text = re.sub(r"(\d+(?:\.\d+)?)\s*%\s*(?:of)?", r"(\1/100)*", text)
    text = text.strip().rstrip("=?* ").strip()
    try:
        return _number(_eval(ast.parse(text, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError, OverflowError) as exc:
        return f"Error: cannot evaluate {expression!r} ({exc})"


# ---------------------------------------------------------------------- units
# Length in metres, mass in kilograms, volume in litres.
_UNITS = {"km": ("length", 1000.0), "kilometer": ("length", 1000.0), "kilometre": ("length", 1000.0),
          "mi": ("length", 1609.344), "mile": ("length", 1609.344), "m": ("length", 1.0),
          "meter": ("length", 1.0), "metre": ("length", 1.0), "ft": ("length", 0.3048),
          "foot": ("length", 0.3048), "feet": ("length", 0.3048), "inch": ("length", 0.0254),
          "in": ("length", 0.0254), "cm": ("length", 0.01), "centimeter": ("length", 0.01),
          "kg": ("mass", 1.0), "kilogram": ("mass", 1.0), "lb": ("mass", 0.45359237),
          "pound": ("mass", 0.45359237), "g": ("mass", 0.001), "gram": ("mass", 0.001),
          "l": ("volume", 1.0), "liter": ("volume", 1.0), "litre": ("volume", 1.0),
          "gallon": ("volume", 3.785411784), "gal": ("volume", 3.785411784)}


def _unit(name: str) -> tuple[str, float] | None:
    k = _key(name)
    return _UNITS.get(k) or _UNITS.get(k[:-1] if k.endswith("s") else k) or (
        _UNITS.get(k[:-2]) if k.endswith("es") else None)


def convert_units(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a quantity between units of length, mass or volume (km, miles, kg, pounds, litres, ...)."""
    src, dst = _unit(from_unit), _unit(to_unit)
    if src is None or dst is None or src[0] != dst[0]:
        return f"Error: cannot convert {from_unit!r} to {to_unit!r}"
    return f"{_number(round(value * src[1] / dst[1], 2))} {to_unit}"


# ---------------------------------------------------------------------- time
_OFFSETS = {"london": 0, "paris": 1, "berlin": 1, "cairo": 2, "moscow": 3, "dubai": 4, "delhi": 5,
            "tokyo": 9, "sydney": 11, "newyork": -5, "chicago": -6, "losangeles": -8}


def get_time(city: str) -> str:
    """Get the current local time in a city."""
    offset = _OFFSETS.get(_key(city), _seeded(city, -8, 10))
    return f"{(_UTC_HOUR + offset) % 24:02d}:00"


# ---------------------------------------------------------------------- money and countries
_PER_USD = {"usd": 1.0, "dollar": 1.0, "eur": 0.92, "euro": 0.92, "gbp": 0.79, "pound": 0.79,
            "jpy": 151.0, "yen": 151.0, "chf": 0.88, "franc": 0.88, "cad": 1.36, "inr": 83.0, "rupee": 83.0}


def _currency(name: str) -> float | None:
    k = _key(name)
    for key, rate in _PER_USD.items():
        if k.startswith(key) or k.endswith(key) or k.rstrip("s").endswith(key):
            return rate
    return None


def convert_currency(amount: float, from_currency: str, to_currency: str) -> str:
    """Convert an amount of money from one currency to another (USD, EUR, GBP, JPY, ...)."""
    src, dst = _currency(from_currency), _currency(to_currency)
    if src is None or dst is None:
        return f"Error: unknown currency {from_currency if src is None else to_currency!r}"
    return f"{amount * dst / src:.2f} {to_currency}"


_POPULATION = {"canada": 40_100_000, "brazil": 216_400_000, "france": 68_200_000, "japan": 124_500_000,
               "germany": 84_500_000, "india": 1_428_600_000, "egypt": 112_700_000}


def get_population(country: str) -> str:
    """Get the population of a country."""
    return f"{_POPULATION.get(_key(country), _seeded(country, 1, 90) * 1_000_000):,}"


# ---------------------------------------------------------------------- books and words
_AUTHORS = {"dracula": "Bram Stoker", "frankenstein": "Mary Shelley", "mobydick": "Herman Melville",
            "prideandprejudice": "Jane Austen", "thehobbit": "J. R. R. Tolkien", "hobbit": "J. R. R. Tolkien"}


def book_author(title: str) -> str:
    """Find who wrote a book, given its title."""
    return _AUTHORS.get(_key(title), "No book with that title was found")


_WORDS = {"ephemeral": "lasting a very short time", "serendipity": "finding good things by chance",
          "ubiquitous": "found everywhere", "laconic": "using very few words"}


def define_word(word: str) -> str:
    """Look up the meaning of an English word."""
    return _WORDS.get(_key(word), f"No definition found for {word!r}")


# ---------------------------------------------------------------------- shares and translation
_SYMBOLS = {"apple": "AAPL", "microsoft": "MSFT", "google": "GOOGL", "alphabet": "GOOGL", "amazon": "AMZN",
            "tesla": "TSLA"}


def stock_price(symbol: str) -> str:
    """Get the latest share price of a company, by ticker symbol or company name."""
    ticker = _SYMBOLS.get(_key(symbol), symbol.strip().upper())
    return f"{ticker}: {_seeded(ticker, 50, 450)}.{_seeded(ticker[::-1], 10, 99)} USD"


_PHRASES = {("thankyou", "spanish"): "gracias", ("goodmorning", "french"): "bonjour",
            ("hello", "german"): "hallo", ("goodnight", "italian"): "buona notte",
            ("thankyou", "french"): "merci", ("hello", "spanish"): "hola"}


def translate(text: str, language: str) -> str:
    """Translate a short English phrase into another language."""
    return _PHRASES.get((_key(text), _key(language)), f"No translation of {text!r} into {language}")


TOOLS: dict[str, Callable[..., str]] = {f.__name__: f for f in (
    get_weather, calculator, convert_units, get_time, convert_currency, get_population, book_author, define_word,
    stock_price, translate)}
