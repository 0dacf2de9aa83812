"""The connector's cost in vLLM's scheduler loop: per step and per request, against no connector.

    python -m kvtier.bench.scheduler_cost [--context 8192] [--users 8] [--rounds 6] [--json]

vLLM's engine core runs its scheduler, and with it the connector's scheduler side (lookups,
load and save planning, block tables), on one thread between the model's steps: whatever the
connector adds there, every request waits for, hidden only where the GPU's step is longer and
scheduling overlaps it. This measures that cost where it can be measured alone: the installed
vLLM's own Scheduler, with no model (kvtier.vllm.model_free), runs the same multi-round chat
twice, once with no connector and once with KvtierConnector against a `kvtier serve` it starts,
the two stepped in turn so that both see the same machine state. Each conversation's next turn
repeats its last prompt and answer and adds a question (LMCache's multi-round semantics), vLLM's
KV cache holds every conversation (the regime where offload is never read: issue 33's 8k), and
the stand-in workers store what the connector hands out to save, so that its lookups find the
chunks of earlier turns as in a real run.

It prints, per arm, the scheduler's time per step (schedule() plus update_from_output()) and
per request, the difference, and the connector's lookups: how many, how many made a request
wait a step, and the time the loop spent waiting on them. The model's size does not enter (the
scheduler side handles token ids and block ids, never KV bytes): a tiny model's shape keeps the
stand-in workers' stores small. The machine's Python speed does: compare arms of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# A tiny Llama's shape (4 layers, 2 KV heads of 64, float32: 4 KiB of KV a token, 1 MiB a
# 256-token chunk), long enough for any context asked.
def _model_config(max_len: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32000,
            "max_position_embeddings": max_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
            "torch_dtype": "float32"}


CHUNK_BYTES = 256 * 4 * 2 * 2 * 64 * 4


class Chat:
    """One user's conversation: each turn's prompt is the last prompt, its answer and a new
    question; the first turn starts with the shared system prompt and the user's history."""

    def __init__(self, user: int, system: list[int], history: int, question: int,
                 answer: list[int], rounds: int):
        rng = random.Random(1000 + user)
        self.prompt = system + [rng.randrange(3, 32000) for _ in range(history)]
        self.rng, self.question, self.answer, self.rounds = rng, question, answer, rounds
        self.round = 0

    def next_prompt(self, answered: bool) -> list[int] | None:
        if self.round >= self.rounds:
            return None
        if answered:
            self.prompt = self.prompt + self.answer
        self.prompt = self.prompt + [self.rng.randrange(3, 32000) for _ in range(self.question)]
        self.round += 1
        return self.prompt


class Arm:
    """One engine's closed loop: every user sends its next turn once the last was answered."""

    def __init__(self, name: str, engine, args, answer_token: int):
        self.name, self.engine, self.args = name, engine, args
        system = random.Random(1).choices(range(3, 32000), k=args.system)
        history = max(0, args.context - args.system - args.rounds * (args.question + args.answer))
        answer = [answer_token] * args.answer  # what the stand-in model runner answers
        self.chats = [Chat(u, system, history, args.question, answer, args.rounds)
                      for u in range(args.users)]
        self.active: dict[str, int] = {}  # request id -> user
        self.requests = 0
        self.prompt_tokens = 0
        self.step_s: list[float] = []
        for u in range(args.users):
            self._send(u, answered=False)

    def _send(self, user: int, answered: bool) -> None:
        prompt = self.chats[user].next_prompt(answered)
        if prompt is None:
            return
        req_id = f"u{user}-r{self.chats[user].round}"
        self.engine.add(req_id, prompt, max_tokens=self.args.answer)
        self.active[req_id] = user
        self.requests += 1
        self.prompt_tokens += len(prompt)

    def done(self) -> bool:
        return not self.active and self.engine.idle()

    def step(self) -> None:
        e = self.engine
        before = len(e.schedule_s)
        finished_before = len(e.finished_ids)
        e.step()
        self.step_s.append(e.schedule_s[before] + e.update_s[before])
        for req_id in e.finished_ids[finished_before:]:
            user = self.active.pop(req_id, None)
            if user is not None:
                self._send(user, answered=True)


def run(args) -> dict:
    from kvtier.bench.ttft_storage import ServeProcess
    from kvtier.vllm.model_free import SAMPLED_TOKEN, ModelFreeEngine

    work = tempfile.mkdtemp(prefix="kvtier-scheduler-cost-")
    max_len = args.context + args.answer + 1024
    os.makedirs(os.path.join(work, "model"))
    with open(os.path.join(work, "model", "config.json"), "w") as f:
        json.dump(_model_config(max_len), f)
    # vLLM's cache holds every conversation: this many blocks of 16 tokens, and a margin.
    blocks = args.users * (max_len // 16 + 2) + 64
    chunks = args.users * (max_len // 256 + 1)
    server = ServeProcess(args.kvtier, CHUNK_BYTES, max(0.25, 1.5 * chunks * CHUNK_BYTES / 2**30),
                          work)
    arms = []
    try:
        common = dict(num_blocks=blocks, max_batched_tokens=args.max_batched_tokens,
                      max_model_len=max_len, max_num_seqs=max(args.users, 8))
        none = ModelFreeEngine(os.path.join(work, "model"), None, **common)
        kvtier_engine = ModelFreeEngine(os.path.join(work, "model"), server.socket, **common)
        arms = [Arm("none", none, args, SAMPLED_TOKEN),
                Arm("kvtier serve", kvtier_engine, args, SAMPLED_TOKEN)]
        started = time.monotonic()
        last_report = started
        while not all(a.done() for a in arms):
            for arm in arms:  # in turn: the same machine state for both
                if not arm.done():
                    arm.step()
            now = time.monotonic()
            if now - last_report > 10:
                last_report = now
                print(f"[{now - started:5.0f} s] " + ", ".join(
                    f"{a.name}: {a.requests} requests, {len(a.step_s)} steps" for a in arms),
                    file=sys.stderr)
            if now - started > args.timeout:
                raise RuntimeError(f"not done within {args.timeout:.0f} s")
        counters = kvtier_engine.connector_counters
    finally:
        for arm in arms:
            arm.engine.close()
        server.stop()
    result = {"context": args.context, "users": args.users, "rounds": args.rounds,
              "system": args.system, "question": args.question, "answer": args.answer,
              "max_batched_tokens": args.max_batched_tokens, "arms": {}}
    for arm in arms:
        steps = arm.step_s
        result["arms"][arm.name] = {
            "requests": arm.requests, "prompt_tokens": arm.prompt_tokens, "steps": len(steps),
            "step_us_mean": 1e6 * statistics.fmean(steps),
            "step_us_p50": 1e6 * _quantile(steps, 0.5),
            "step_us_p99": 1e6 * _quantile(steps, 0.99),
            "scheduler_ms_per_request": 1e3 * sum(steps) / arm.requests}
    base, conn = result["arms"]["none"], result["arms"]["kvtier serve"]
    result["added_ms_per_request"] = (conn["scheduler_ms_per_request"]
                                      - base["scheduler_ms_per_request"])
    result["added_us_per_step"] = conn["step_us_mean"] - base["step_us_mean"]
    result["lookups"] = counters.get("lookups", 0)
    result["lookups_deferred"] = counters.get("lookups_deferred", 0)
    result["lookup_wait_ms_per_request"] = counters.get("lookup_wait_us", 0) / 1e3 / conn["requests"]
    result["saves_skipped"] = counters.get("saves_skipped", 0)
    return result


def report(r: dict) -> str:
    lines = [f"vLLM's scheduler, no model: {r['users']} users x {r['rounds']} turns to "
             f"{r['context']} tokens (system {r['system']}, question {r['question']}, answer "
             f"{r['answer']}), {r['max_batched_tokens']} tokens a step",
             f"{'arm':<14}{'requests':>9}{'steps':>7}{'us/step mean':>14}{'p50':>8}{'p99':>8}"
             f"{'ms/request':>12}"]
    for name, a in r["arms"].items():
        lines.append(f"{name:<14}{a['requests']:>9}{a['steps']:>7}{a['step_us_mean']:>14.0f}"
                     f"{a['step_us_p50']:>8.0f}{a['step_us_p99']:>8.0f}"
                     f"{a['scheduler_ms_per_request']:>12.2f}")
    lines.append(f"the connector adds {r['added_us_per_step']:.0f} us a step, "
                 f"{r['added_ms_per_request']:.2f} ms a request of scheduler-loop time; lookups "
                 f"{r['lookups']}, {r['lookups_deferred']} made a request wait a step, "
                 f"{r['lookup_wait_ms_per_request']:.2f} ms a request waiting on them; "
                 f"{r['saves_skipped']} chunks of vLLM's own hits not saved again")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvtier.bench.scheduler_cost",
        description="The connector's cost in vLLM's scheduler loop, per step and per request, "
                    "against no connector (the installed vLLM's Scheduler, no model).")
    p.add_argument("--context", type=int, default=8192,
                   help="tokens of a conversation's last turn (default 8192)")
    p.add_argument("--users", type=int, default=8, help="concurrent conversations (default 8)")
    p.add_argument("--rounds", type=int, default=6, help="turns per conversation (default 6)")
    p.add_argument("--system", type=int, default=1000,
                   help="shared system prompt tokens (default 1000)")
    p.add_argument("--question", type=int, default=100,
                   help="new tokens a turn asks (default 100)")
    p.add_argument("--answer", type=int, default=100, help="tokens a turn answers (default 100)")
    p.add_argument("--max-batched-tokens", type=int, default=8192,
                   help="vLLM's max_num_batched_tokens (default 8192)")
    p.add_argument("--timeout", type=float, default=600, help="give up after this many s")
    p.add_argument("--kvtier", default="kvtier", help="the kvtier CLI (default: on PATH)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    for name in ("context", "users", "rounds", "answer", "max_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.system < 0 or args.question < 0:
        p.error("--system and --question must be at least 0")
    if args.system + args.rounds * (args.question + args.answer) > args.context:
        p.error("--context is shorter than the system prompt and every turn's question and answer")
    try:
        result = run(args)
    except (RuntimeError, OSError) as e:
        print(f"scheduler_cost: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
