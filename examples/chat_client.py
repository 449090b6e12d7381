"""A two-turn chat through running nodes: edgelite probes them, plans, deploys and streams.

    edgelite node --port 7070 --token SECRET    # on each phone (or twice here, two ports)
    python examples/chat_client.py --model models/smollm2-135m --nodes HOST:7070,HOST:7071 \\
        --token SECRET
"""

import argparse
import asyncio

import edgelite


async def main(args: argparse.Namespace) -> None:
    async with edgelite.connect(args.model, nodes=args.nodes.split(","), token=args.token) as llm:
        print("plan:", [(s.device, s.first, s.last) for s in llm.plan.stages])
        if llm.plan.with_nodes_ms is not None:  # the nodes got no layer: say why
            print(f"every layer runs here: predicted {llm.plan.predicted.expected:.1f} ms/token "
                  f"alone vs {llm.plan.with_nodes_ms:.1f} with the nodes")
        history = []
        for question in ("Name a planet in our solar system.", "How far is it from the Sun?"):
            history.append({"role": "user", "content": question})
            print(f"> {question}")
            reply = llm.chat(history, max_tokens=args.max_tokens)
            async for piece in reply:
                print(piece.text, end="", flush=True)
            history.append({"role": "assistant", "content": reply.text})
            print()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--nodes", required=True, help="HOST:PORT,...")
    ap.add_argument("--token", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    asyncio.run(main(ap.parse_args()))
