"""workflows.py: rollout workflows for the RL recipes (``rollout.workflow: examples/workflows.py:NAME``).

A workflow is called once per sample with ``client`` (an openai client bound to the rollout server
that records every completion's exact tokens) and ``row`` (the data row: prompt, prompt_ids,
answer, ...); it returns the episode's reward. Its turns are trained where the model sampled.

    check_and_retry   the embedded addition task: answer; if wrong, the question is asked again
                      after the wrong answer (one joined row, loss on both answers)
    calculator        a chat model with a calculator tool (needs a chat template with tools):
                      tool calls are executed and their results sent back until an answer
    chat_answer       the openai package's async chat API directly, one turn, math reward

Run: fsdpfn run examples/grpo.yaml rollout.workflow=examples/workflows.py:check_and_retry
(check_and_retry on the embedded task).
"""

from __future__ import annotations

import ast
import json
import operator

from fsdpfn.app.recipes.rewards import math as math_reward


def check_and_retry(client, row):
    """Answer; when wrong, the question again after the wrong answer (token ids throughout, so
    the second prompt extends the first turn exactly). 1 right first, 0.5 right second, else 0."""
    first = client.completions.create(model="policy", prompt=row["prompt_ids"], max_tokens=8,
                                      temperature=1.0)
    choice = first.choices[0]
    if choice.text.strip() == row["answer"]:
        return 1.0
    again = choice.prompt_token_ids + choice.token_ids + row["prompt_ids"]
    second = client.completions.create(model="policy", prompt=again, max_tokens=8,
                                       temperature=1.0)
    return 0.5 if second.choices[0].text.strip() == row["answer"] else 0.0


CALCULATOR = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression (+ - * / and parentheses)",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def _evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("not arithmetic")


def calculate(expression: str) -> str:
    try:
        return str(_evaluate(ast.parse(expression, mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError, TypeError) as exc:
        return f"error: {exc}"


def calculator(client, row, max_calls: int = 4):
    """Chat with a calculator tool: run each call, send its result back, until an answer."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(max_calls + 1):
        reply = client.chat.completions.create(model="policy", messages=messages,
                                               tools=CALCULATOR, max_tokens=256)
        message = reply.choices[0].message
        if not message.tool_calls:
            return math_reward(row["prompt"], message.content or "", answer=row["answer"],
                               sample=row)
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [
            c.model_dump() for c in message.tool_calls]})
        for call in message.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(str(args.get("expression", "")))})
    return 0.0


async def chat_answer(client, row):
    """The openai package's async API as an agent framework would call it."""
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=256)
    return math_reward(row["prompt"], reply.choices[0].message.content or "",
                       answer=row["answer"], sample=row)
