"""The same essay judge written against the raw openai client."""

import base64
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

DIMENSIONS = ["Clarity", "Originality", "Evidence"]
RESULT_REGEX = r'\{"summary": "[\w\d\s,.]*", "grade": "[ABCD][+-]?"\}'


def essay_judge(client, model, image_path, essay):
    with open(image_path, "rb") as f:
        image_url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    messages = [
        {"role": "system", "content": "You evaluate essays about images."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "text", "text": "Essay: " + essay},
        ]},
        {"role": "assistant", "content": "Understood."},
        {"role": "user", "content": "Is the essay related to the image? Answer yes or no."},
    ]
    # A select scored by logprobs needs more code; a regex-constrained answer stands in for it here.
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, temperature=0, extra_body={"regex": "(yes|no)"}
    )
    related = reply.choices[0].message.content
    messages.append({"role": "assistant", "content": related})
    if related == "no":
        return {"related": related}

    def judge(dim):
        branch = messages + [{"role": "user", "content": "Judge the essay on " + dim + " in one sentence."}]
        reply = client.chat.completions.create(model=model, messages=branch, max_tokens=64, stop=["\n"])
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(DIMENSIONS)) as pool:
        judgments = list(pool.map(judge, DIMENSIONS))
    messages.append({"role": "user", "content": "Judgments:\n" + "\n".join(judgments)
                     + "\nSummarize and grade the essay as JSON."})
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=96, extra_body={"regex": RESULT_REGEX}
    )
    return {"related": related, "judgment": judgments, "result": reply.choices[0].message.content}


if __name__ == "__main__":
    client = OpenAI(base_url="http://127.0.0.1:30000/v1", api_key="EMPTY")
    print(essay_judge(client, "default", "essay.png", "A cat sleeps on a warm windowsill."))
