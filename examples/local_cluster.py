"""Start two stage nodes inside this process, split a model across them, and generate.

    python examples/local_cluster.py --model models/smollm2-135m "Why is the sky blue?"

The nodes are real asyncio TCP servers on 127.0.0.1 (port 0); the client deploys layer files to
them and streams the reply, exactly as with nodes on phones.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from edgelite import manifest as mf
from edgelite.client.cluster import even_split, in_order, open_cluster
from edgelite.config import GenerationConfig, NodeConfig
from edgelite.engine.generate import Stats, generate
from edgelite.engine.tokenizer import StreamDecoder, Tokenizer
from edgelite.node.server import Node

TOKEN = "example-token"


async def main(model_dir: Path, prompt: str, n_nodes: int, max_tokens: int) -> None:
    m = mf.load(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="edgelite-example-"))
    nodes = [Node(NodeConfig(host="127.0.0.1", port=0, threads=1), TOKEN, tmp / f"node{i}")
             for i in range(n_nodes)]
    async with asyncio.TaskGroup() as tg:
        for node in nodes:
            await node.start()
        serving = [tg.create_task(node.run()) for node in nodes]
        split = even_split(m.num_layers, n_nodes)
        backend = await open_cluster(m, [("127.0.0.1", n.port) for n in nodes], in_order(split),
                                     TOKEN, threads=1)
        try:
            tok, stats = Tokenizer(m), Stats()
            dec = StreamDecoder(tok)
            ids = tok.chat_prompt([{"role": "user", "content": prompt}])
            async for t in generate(backend, ids, GenerationConfig(max_tokens=max_tokens), stats):
                sys.stdout.write(dec.push(t))
                sys.stdout.flush()
            print(f"\n[{len(stats.token_ids)} tokens over {n_nodes} nodes {split}, "
                  f"{stats.decode_tok_s:.1f} tok/s]")
        finally:
            await backend.close()
            for task in serving:
                task.cancel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/smollm2-135m"))
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("prompt", nargs="?", default="Why is the sky blue?")
    a = ap.parse_args()
    asyncio.run(main(a.model, a.prompt, a.nodes, a.max_tokens))
