"""The client API as a library: connect to running nodes, let the planner place the model, and
hold a two-turn conversation.

    edgelite node --port 7070 --token SECRET          # on each phone (or twice here, two ports)
    python examples/chat_client.py --model models/smollm2-135m --nodes HOST:7070,HOST:7071 \\
        --token SECRET
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from edgelite import manifest as mf
from edgelite.cli.deploy import assignment_of, plan_cluster
from edgelite.client.cluster import open_cluster, parse_nodes
from edgelite.config import GenerationConfig
from edgelite.engine.generate import generate
from edgelite.engine.tokenizer import Tokenizer

QUESTIONS = ["Name a planet in our solar system.", "How far is it from the Sun?"]


async def main(args: argparse.Namespace) -> None:
    m = mf.load(args.model)
    addrs = parse_nodes(args.nodes)
    problem, plan, _probe = await plan_cluster(m, addrs, args.token, threads=1)
    print("plan:", [(problem.devices[d].name, a, b) for d, a, b in plan.stages], plan.status)
    backend = await open_cluster(m, addrs, assignment_of(problem, plan, addrs), args.token, threads=1)
    tok, history = Tokenizer(m), []
    try:
        for q in QUESTIONS:
            history.append({"role": "user", "content": q})
            ids = [t async for t in generate(backend, tok.chat_prompt(history),
                                             GenerationConfig(max_tokens=args.max_tokens))]
            answer = tok.decode(ids)
            history.append({"role": "assistant", "content": answer})
            print(f"> {q}\n{answer}\n")
    finally:
        await backend.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/smollm2-135m"))
    ap.add_argument("--nodes", required=True, help="host:port,...")
    ap.add_argument("--token", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    asyncio.run(main(ap.parse_args()))
