#!/usr/bin/env python3
"""Renders the chat templates of tests/server/data/ with Python jinja2, as Hugging Face
transformers' apply_chat_template does (sandboxed environment, trim_blocks, lstrip_blocks,
raise_exception), over a fixed set of conversations, and writes
tests/server/data/chat_template_golden.json: the reference tests/server/test_chat_template.cpp
compares kvq's C++ renderer against. Cases the template refuses are recorded with "error".

usage: scripts/render_chat_templates.py [OUT.json]   (needs: pip install jinja2)
"""
import json
import os
import sys

from jinja2.sandbox import ImmutableSandboxedEnvironment

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "server", "data")
TEMPLATES = [  # (file, bos_token the template's {{ bos_token }} renders)
    ("qwen2.5_chat_template.jinja", ""),
    ("gemma3_chat_template.jinja", "<bos>"),
]

U, A, S = "user", "assistant", "system"
CONVERSATIONS = [
    [{"role": U, "content": "Hello!"}],
    [{"role": S, "content": "You are terse."}, {"role": U, "content": "Write a haiku."}],
    [{"role": U, "content": "  padded\n"}, {"role": A, "content": "\tanswer  "}, {"role": U, "content": "more"}],
    [{"role": S, "content": "sys\n"}, {"role": U, "content": "q1"}, {"role": A, "content": "a1"},
     {"role": U, "content": "q2 with unicode: héllo wörld ✓"}],
    [{"role": U, "content": [{"type": "text", "text": " part one "}, {"type": "text", "text": "part two"}]}],
    [{"role": U, "content": ""}],
    [{"role": U, "content": "a"}, {"role": U, "content": "b"}],  # Gemma refuses (roles must alternate)
    [{"role": S, "content": "only a system message"}],
    [{"role": U, "content": "def f(x):\n    return x * 2\n"}, {"role": A, "content": "Doubles x."}],
    [{"role": U, "content": "first"}, {"role": S, "content": "mid-conversation system"}],
]


def raise_exception(msg):
    raise ValueError(msg)


def render(template_text, bos, messages, add_generation_prompt):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    t = env.from_string(template_text)
    return t.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                    eos_token="", tools=None)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(DATA, "chat_template_golden.json")
    doc = {"generator": "scripts/render_chat_templates.py (jinja2 " + __import__("jinja2").__version__ + ")",
           "templates": []}
    for name, bos in TEMPLATES:
        with open(os.path.join(DATA, name), encoding="utf-8") as f:
            text = f.read()
        cases = []
        for conv in CONVERSATIONS:
            for agp in (True, False):
                case = {"messages": conv, "add_generation_prompt": agp}
                try:
                    case["rendered"] = render(text, bos, conv, agp)
                except Exception as e:  # the template's own refusals (raise_exception) and type errors
                    case["error"] = str(e)
                cases.append(case)
        doc["templates"].append({"file": name, "bos_token": bos, "cases": cases})
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {out}: {sum(len(t['cases']) for t in doc['templates'])} cases")


if __name__ == "__main__":
    main()
