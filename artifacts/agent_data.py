"""Agentic conversations of the project's own making: OpenAI-style records with `tools`, assistant
`tool_calls`, `tool` results and final answers, generated from a seed - training data and a tool-calling
eval workload for any target whose chat template renders tools, with nothing downloaded.

Eight tools (weather, time, currency, calculator, stock price, web search, restaurant booking, e-mail), each
request offered three to five of them; the conversations mix one call, parallel calls, two calls in
sequence, a failed call retried, a follow-up question and no call at all. Tool results are drawn from the
seed, answers are written from them. Different seeds give different conversations (train on one, serve
another):

    python -m artifacts.agent_data out.jsonl --num 200 --seed 0 [--per-request]
    ${agent_data:200,0}    # in a config: the path of that file, written once under ~/.cache/eagle-pipeline
    ${agent_data:200,0,requests}   # the same conversations logged one record per request, as servers log
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from artifacts import atomic


def function(tool_name: str, description: str, **properties) -> dict:
    """An OpenAI tool schema; every property required but `unit`."""
    props = {key: ({"type": kind} if isinstance(kind, str) else {"type": "string", "enum": list(kind)})
             for key, kind in properties.items()}  # fmt: skip
    required = [key for key in properties if key != "unit"]
    parameters = {"type": "object", "properties": props, "required": required}
    return {
        "type": "function",
        "function": {"name": tool_name, "description": description, "parameters": parameters},
    }


TOOLS = {
    "get_weather": function("get_weather", "Current weather in a city.", city="string", unit=("celsius", "fahrenheit")),
    "get_time": function("get_time", "Current local time in an IANA time zone.", timezone="string"),
    "convert_currency": function("convert_currency", "Convert an amount between currencies.", amount="number",
                                 source="string", target="string"),
    "calculator": function("calculator", "Evaluate an arithmetic expression.", expression="string"),
    "get_stock_price": function("get_stock_price", "Latest price of a stock by its ticker symbol.", symbol="string"),
    "search_web": function("search_web", "Search the web and return the top results.", query="string"),
    "book_restaurant": function("book_restaurant", "Book a table at a restaurant.", name="string", time="string",
                                people="integer"),
    "send_email": function("send_email", "Send an e-mail.", to="string", subject="string", body="string"),
}  # fmt: skip

CITIES = {"Paris": "Europe/Paris", "Tokyo": "Asia/Tokyo", "New York": "America/New_York", "Berlin": "Europe/Berlin",
          "Sydney": "Australia/Sydney", "Cairo": "Africa/Cairo", "Lima": "America/Lima", "Oslo": "Europe/Oslo",
          "Mumbai": "Asia/Kolkata", "Toronto": "America/Toronto", "Madrid": "Europe/Madrid", "Seoul": "Asia/Seoul"}  # fmt: skip
SKIES = ["sunny", "cloudy", "rainy", "windy", "snowing", "foggy", "clear"]
CURRENCIES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 149.5, "CHF": 0.88, "CAD": 1.36}
STOCKS = {"AAPL": "Apple", "MSFT": "Microsoft", "NVDA": "Nvidia", "AMZN": "Amazon", "TSLA": "Tesla"}
TOPICS = ["speculative decoding", "the history of the printing press", "how vaccines work", "the rules of chess",
          "growing tomatoes on a balcony", "the tallest mountains in Europe", "how solar panels work"]  # fmt: skip
RESTAURANTS = ["Chez Marie", "Sakura House", "La Trattoria", "The Green Fork", "El Faro"]
PEOPLE = ["alice@example.com", "bob@example.com", "team@example.com", "carol@example.com"]
SYSTEMS = [None, "You are a helpful assistant with access to tools. Call a tool when it helps.",
           "You are a concise assistant. Use the tools you are given."]  # fmt: skip


class Writer:
    """One conversation's messages and the ids of its calls."""

    def __init__(self, rng: random.Random, number: int):
        self.rng, self.number, self.calls, self.messages = rng, number, 0, []

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def call(self, *calls: tuple[str, dict], text: str = "") -> list[str]:
        ids = []
        for _ in calls:
            self.calls += 1
            ids.append(f"call_{self.number}_{self.calls}")
        self.messages.append({"role": "assistant", "content": text or None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in zip(ids, calls)]})  # fmt: skip
        return ids

    def result(self, call_id: str, value) -> None:
        content = value if isinstance(value, str) else json.dumps(value)
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def weather(rng, city, unit="celsius"):
    celsius = rng.randint(-5, 35)
    degrees = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    return {"city": city, "temperature": degrees, "unit": unit, "sky": rng.choice(SKIES)}


def local_time(rng):
    return f"{rng.randint(0, 23):02d}:{rng.choice([0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55]):02d}"


def one_weather(w: Writer) -> list[str]:
    rng = w.rng
    city, unit = rng.choice(list(CITIES)), rng.choice(["celsius", "celsius", "fahrenheit"])
    w.user(rng.choice([f"What's the weather like in {city} right now?", f"Is it cold in {city} today?",
                       f"How warm is it in {city}? Give me {unit}."]))  # fmt: skip
    args = {"city": city} | ({"unit": unit} if unit != "celsius" else {})
    (cid,) = w.call(("get_weather", args))
    r = weather(rng, city, unit)
    w.result(cid, r)
    w.answer(f"It is {r['temperature']} degrees {unit} and {r['sky']} in {city} right now.")
    return ["get_weather"]


def parallel_weather(w: Writer) -> list[str]:
    rng = w.rng
    a, b = rng.sample(list(CITIES), 2)
    w.user(f"Compare the weather in {a} and {b}. Which one is warmer?")
    ids = w.call(("get_weather", {"city": a}), ("get_weather", {"city": b}))
    ra, rb = weather(rng, a), weather(rng, b)
    w.result(ids[0], ra)
    w.result(ids[1], rb)
    warmer = a if ra["temperature"] >= rb["temperature"] else b
    w.answer(f"{a}: {ra['temperature']} degrees and {ra['sky']}. {b}: {rb['temperature']} degrees and "
             f"{rb['sky']}. {warmer} is warmer.")  # fmt: skip
    return ["get_weather"]


def time_then_calculate(w: Writer) -> list[str]:
    rng = w.rng
    city = rng.choice(list(CITIES))
    w.user(f"How many minutes are left until midnight in {city}?")
    (cid,) = w.call(("get_time", {"timezone": CITIES[city]}))
    now = local_time(rng)
    w.result(cid, {"timezone": CITIES[city], "time": now})
    hours, minutes = map(int, now.split(":"))
    expression = f"24 * 60 - ({hours} * 60 + {minutes})"
    (cid,) = w.call(("calculator", {"expression": expression}))
    left = 24 * 60 - (hours * 60 + minutes)
    w.result(cid, str(left))
    w.answer(f"It is {now} in {city}, so there are {left} minutes left until midnight.")
    return ["get_time", "calculator"]


def currency(w: Writer) -> list[str]:
    rng = w.rng
    source, target = rng.sample(list(CURRENCIES), 2)
    amount = rng.choice([10, 25, 50, 100, 250, 1000, 1999.5])
    w.user(
        rng.choice(
            [f"How much is {amount} {source} in {target}?", f"Convert {amount} {source} to {target}, please."]
        )
    )
    (cid,) = w.call(("convert_currency", {"amount": amount, "source": source, "target": target}))
    value = round(amount / CURRENCIES[source] * CURRENCIES[target], 2)
    w.result(cid, {"amount": value, "currency": target})
    w.answer(f"{amount} {source} is about {value} {target}.")
    return ["convert_currency"]


def failed_calculation(w: Writer) -> list[str]:
    rng = w.rng
    x, y, z = rng.randint(12, 999), rng.randint(2, 99), rng.randint(2, 9)
    w.user(f"What is ({x} + {y}) * {z}?")
    (cid,) = w.call(("calculator", {"expression": f"({x} + {y} * {z}"}), text="Let me calculate that.")
    w.result(cid, "Error: unbalanced parentheses in expression")
    (cid,) = w.call(("calculator", {"expression": f"({x} + {y}) * {z}"}))
    w.result(cid, str((x + y) * z))
    w.answer(f"({x} + {y}) * {z} = {(x + y) * z}.")
    return ["calculator"]


def stock_follow_up(w: Writer) -> list[str]:
    rng = w.rng
    symbol = rng.choice(list(STOCKS))
    w.user(f"What is {STOCKS[symbol]} trading at?")
    (cid,) = w.call(("get_stock_price", {"symbol": symbol}))
    price = round(rng.uniform(50, 900), 2)
    w.result(cid, {"symbol": symbol, "price": price, "currency": "USD"})
    w.answer(f"{STOCKS[symbol]} ({symbol}) is trading at {price} USD.")
    target = rng.choice(["EUR", "GBP", "JPY"])
    w.user(f"And in {target}?")
    (cid,) = w.call(("convert_currency", {"amount": price, "source": "USD", "target": target}))
    value = round(price * CURRENCIES[target], 2)
    w.result(cid, {"amount": value, "currency": target})
    w.answer(f"That is about {value} {target}.")
    return ["get_stock_price", "convert_currency"]


def search(w: Writer) -> list[str]:
    rng = w.rng
    topic = rng.choice(TOPICS)
    w.user(f"Can you look up {topic} and give me a short summary?")
    (cid,) = w.call(("search_web", {"query": topic}))
    results = [{"title": f"{topic.capitalize()}: an overview", "snippet": f"An introduction to {topic}."},
               {"title": f"Ten facts about {topic}", "snippet": f"What most people do not know about {topic}."}]  # fmt: skip
    w.result(cid, results)
    w.answer(f"Here is what I found about {topic}: the top result is an overview that introduces it, and a second "
             f"page lists ten lesser-known facts. Want me to open one of them?")  # fmt: skip
    return ["search_web"]


def booking_and_email(w: Writer) -> list[str]:
    rng = w.rng
    name, people, hour = rng.choice(RESTAURANTS), rng.randint(2, 8), rng.randint(18, 21)
    to = rng.choice(PEOPLE)
    w.user(f"Book a table for {people} at {name} at {hour}:00 and e-mail {to} the details.")
    (cid,) = w.call(("book_restaurant", {"name": name, "time": f"{hour}:00", "people": people}))
    code = f"R{rng.randint(1000, 9999)}"
    w.result(cid, {"status": "confirmed", "confirmation": code})
    body = f"Table for {people} at {name}, {hour}:00. Confirmation {code}."
    (cid,) = w.call(("send_email", {"to": to, "subject": f"Dinner at {name}", "body": body}))
    w.result(cid, {"status": "sent"})
    w.answer(
        f"Done: a table for {people} at {name} at {hour}:00 is confirmed ({code}), and {to} has the details."
    )
    return ["book_restaurant", "send_email"]


def no_call(w: Writer) -> list[str]:
    rng = w.rng
    question, answer = rng.choice([
        ("What does a barometer measure?", "A barometer measures air pressure."),
        ("Thanks, that's all for now.", "You're welcome! Ask me anytime."),
        ("Can you explain what an API is in one sentence?",
         "An API is a defined way for one program to ask another for data or actions."),
        ("What is 7 times 8?", "7 times 8 is 56."),
    ])  # fmt: skip
    w.user(question)
    w.answer(answer)
    return []


AGENT_WORKLOAD_SEED = 1  # eval's `agent` workload; training data from it would be trained on what is measured
SHAPES = [one_weather, parallel_weather, time_then_calculate, currency, failed_calculation, stock_follow_up,
          search, booking_and_email, no_call]  # fmt: skip


def conversations(num: int, seed: int) -> list[dict]:
    """`num` conversations from `seed`, the shapes in turn, each offered its tools and one to three others."""
    rng = random.Random(seed)
    records = []
    for number in range(num):
        writer = Writer(rng, number)
        system = rng.choice(SYSTEMS)
        if system:
            writer.messages.append({"role": "system", "content": system})
        used = SHAPES[number % len(SHAPES)](writer)
        others = rng.sample([name for name in TOOLS if name not in used], rng.randint(1, 3))
        names = sorted(set(used) | set(others), key=list(TOOLS).index)
        records.append(
            {"id": f"agent-{seed}-{number}", "tools": [TOOLS[n] for n in names], "messages": writer.messages}
        )
    return records


def request_log(record: dict, shape: str = "request") -> list[dict]:
    """The records a server (or a logging proxy) writes for one conversation: one per assistant turn, the
    history as the client sent it back (assistant turns without their reasoning) and the turn as the
    response - `{"request": {...}, "response": {"choices": [...]}}`, or with `shape="messages"` the history
    and the response in one `messages` list."""
    records = []
    for k, message in enumerate(record["messages"]):
        if message["role"] != "assistant":
            continue
        history = [{key: v for key, v in m.items() if key not in ("reasoning", "reasoning_content")}
                   for m in record["messages"][:k]]  # fmt: skip
        request = {"model": "target", "messages": history} | (
            {"tools": record["tools"]} if "tools" in record else {}
        )
        if shape == "request":
            finish = "tool_calls" if message.get("tool_calls") else "stop"
            choice = {"index": 0, "message": message, "finish_reason": finish}
            records.append(
                {"id": f"{record['id']}-{k}", "request": request, "response": {"choices": [choice]}}
            )
        else:
            records.append({"id": f"{record['id']}-{k}", **request, "messages": [*history, message]})
    return records


def write(path: Path, num: int, seed: int, per_request: bool = False) -> Path:
    records = conversations(num, seed)
    if per_request:
        records = [logged for record in records for logged in request_log(record)]
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    atomic.write_bytes_if_changed(Path(path), lines.encode("utf-8"))
    return Path(path)


def agent_data_path(num: int, seed: int, layout: str = "conversations") -> str:
    """`${agent_data:num,seed}`: the file of `conversations(num, seed)`, written once into the asset cache;
    `${agent_data:num,seed,requests}`: the same logged one record per request (`request_log`)."""
    if layout not in ("conversations", "requests"):
        raise ValueError(f"agent_data:{num},{seed},{layout}: the layout is conversations or requests")
    root = Path(os.environ.get("EAGLE_ASSETS_DIR", Path.home() / ".cache" / "eagle-pipeline"))
    suffix = "" if layout == "conversations" else "-requests"
    path = root / f"agent_data-{int(num)}-{int(seed)}{suffix}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path, int(num), int(seed), layout == "requests")
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--num", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-request", action="store_true", help="one record per request, as servers log")
    args = parser.parse_args()
    print(write(args.out, args.num, args.seed, args.per_request))


if __name__ == "__main__":
    main()
