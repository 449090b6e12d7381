"""Start two stage nodes inside this process, split a model across them, and generate.

    python examples/local_cluster.py --model models/smollm2-135m "Why is the sky blue?"

The nodes are real asyncio TCP servers on 127.0.0.1 (port 0); the client deploys layer files to
them and streams the reply, exactly as with nodes on phones. Their files go to a temporary
folder that is removed at the end.
"""

import argparse
import asyncio
import contextlib
import tempfile

import edgelite

TOKEN = "example-token"


async def main(args: argparse.Namespace) -> None:
    n_layers = edgelite.load_manifest(args.model).num_layers
    half = n_layers // 2
    split = [(0, half - 1), (half, n_layers - 1)]
    with tempfile.TemporaryDirectory(prefix="edgelite-example-") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            cfg = edgelite.NodeConfig(host="127.0.0.1", port=0,
                                      runtime=edgelite.RuntimeConfig(threads=1))
            nodes = [await stack.enter_async_context(edgelite.run_node(TOKEN, f"{tmp}/node{i}", cfg))
                     for i in range(2)]
            llm = await stack.enter_async_context(edgelite.connect(
                args.model, nodes=[n.addr for n in nodes], token=TOKEN, split=split,
                runtime=edgelite.RuntimeConfig(threads=1)))
            reply = llm.chat([{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens)
            async for piece in reply:
                print(piece.text, end="", flush=True)
            print(f"\n[{len(reply.token_ids)} tokens over 2 nodes {split}, "
                  f"{reply.stats.decode_tok_s:.1f} tok/s]")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("prompt", nargs="?", default="Why is the sky blue?")
    asyncio.run(main(ap.parse_args()))
