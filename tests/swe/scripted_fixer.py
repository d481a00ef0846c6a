"""A scripted external coding agent for the black-box harness: a separate program that knows nothing of
miles-agent. It asks the model (through the proxy, with the OpenAI client), reads the issue from the
environment, fixes numkit's clamp through the environment's bash tool, and asks the model once more."""

import json
import os
import urllib.request

from openai import OpenAI


def env_call(path, body=None):
    request = urllib.request.Request(os.environ["MILES_ENV_URL"] + path, data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def main():
    task = env_call("/task")
    assert "clamp" in task["messages"][-1]["content"]
    assert [t["function"]["name"] for t in task["tools"]] == ["bash"]
    client = OpenAI(max_retries=0)
    messages = list(task["messages"])
    first = client.chat.completions.create(model="policy", messages=messages, tools=task["tools"])
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    fix = "sed -i '35s/return lo/return hi/' numkit/stats.py && sed -n 34,35p numkit/stats.py"
    out = env_call("/tools/call", {"name": "bash", "arguments": {"command": fix}})["content"]
    assert "return hi" in out, out
    messages.append({"role": "user", "content": out})
    client.chat.completions.create(model="policy", messages=messages, tools=task["tools"])


if __name__ == "__main__":
    main()
