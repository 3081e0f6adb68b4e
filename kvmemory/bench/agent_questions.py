"""The agent benchmark's questions (`bench/agents.py`): two sets, written apart.

- `HELD_OUT`: the 12 questions the benchmark reports on. They were written (and committed) before
  any margin of the after-result policy (`adapters/after_tool.py`) was measured or set, and nothing
  was tuned on them; they are not to be edited to fit a result.
- `CALIBRATION`: other questions, other wordings (some needing two calls), the only ones any margin
  may be chosen on (`python -m kvmemory.bench.agents --set calibration`).

Every question gives the agent two tools (`agent_tools.TOOLS`); `expected` names the tools a good
agent calls, in any order (two for a question that needs both).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ToolQuestion:
    """A question, the two tools the agent is given, and the tools its answer needs."""

    question: str
    tools: tuple[str, str]
    expected: tuple[str, ...]


HELD_OUT: tuple[ToolQuestion, ...] = (
    ToolQuestion("What's the weather like in Tokyo right now?", ("get_weather", "calculator"), ("get_weather",)),
    ToolQuestion("Can you work out 23 times 19 for me?", ("get_weather", "calculator"), ("calculator",)),
    ToolQuestion("How many kilometers is 26 miles?", ("convert_units", "get_time"), ("convert_units",)),
    ToolQuestion("What time is it in Sydney at the moment?", ("convert_units", "get_time"), ("get_time",)),
    ToolQuestion("How many euros would I get for 150 US dollars?", ("convert_currency", "get_population"),
                 ("convert_currency",)),
    ToolQuestion("How many people live in Canada?", ("convert_currency", "get_population"), ("get_population",)),
    ToolQuestion("Who is the author of Dracula?", ("book_author", "define_word"), ("book_author",)),
    ToolQuestion("What does the word ephemeral mean?", ("book_author", "define_word"), ("define_word",)),
    ToolQuestion("What is Apple's share price today?", ("stock_price", "translate"), ("stock_price",)),
    ToolQuestion("How do you say 'thank you' in Spanish?", ("stock_price", "translate"), ("translate",)),
    ToolQuestion("Is it hot in Cairo today?", ("get_weather", "convert_units"), ("get_weather",)),
    ToolQuestion("What is 15% of 240?", ("calculator", "get_time"), ("calculator",)),
)

CALIBRATION: tuple[ToolQuestion, ...] = (
    ToolQuestion("What is the weather in Berlin?", ("get_weather", "calculator"), ("get_weather",)),
    ToolQuestion("What is 347 multiplied by 29?", ("get_weather", "calculator"), ("calculator",)),
    ToolQuestion("Convert 5 kilograms to pounds.", ("convert_units", "get_time"), ("convert_units",)),
    ToolQuestion("What's the local time in Tokyo?", ("convert_units", "get_time"), ("get_time",)),
    ToolQuestion("What is the population of Brazil?", ("convert_currency", "get_population"), ("get_population",)),
    ToolQuestion("Define the word 'serendipity'.", ("book_author", "define_word"), ("define_word",)),
    ToolQuestion("Translate 'good morning' into French.", ("stock_price", "translate"), ("translate",)),
    ToolQuestion("What's the stock price of Microsoft?", ("stock_price", "calculator"), ("stock_price",)),
    ToolQuestion("Who wrote Frankenstein?", ("book_author", "get_weather"), ("book_author",)),
    ToolQuestion("How much is 40 pounds sterling in dollars?", ("convert_currency", "calculator"),
                 ("convert_currency",)),
    # Questions that need two calls: a second call after the first result is right here.
    ToolQuestion("What is the weather in Rome, and what is 17 times 3?", ("get_weather", "calculator"),
                 ("get_weather", "calculator")),
    ToolQuestion("What time is it in London, and how many feet are 100 meters?", ("convert_units", "get_time"),
                 ("get_time", "convert_units")),
)

SETS = {"held-out": HELD_OUT, "calibration": CALIBRATION}
