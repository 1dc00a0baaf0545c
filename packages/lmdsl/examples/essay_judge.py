"""Essay judge in lmdsl: an image, parallel judgments per dimension, a select, regex-constrained JSON."""

import lmdsl as sgl

DIMENSIONS = ["Clarity", "Originality", "Evidence"]
RESULT_REGEX = r'\{"summary": "[\w\d\s,.]*", "grade": "[ABCD][+-]?"\}'


@sgl.function
def essay_judge(s, image_path, essay):
    s += sgl.system("You evaluate essays about images.")
    s += sgl.user(sgl.image(image_path) + "Essay: " + essay)
    s += sgl.assistant("Understood.")
    s += sgl.user("Is the essay related to the image? Answer yes or no.")
    s += sgl.assistant(sgl.select("related", choices=["yes", "no"]))
    if s["related"] == "no":
        return
    forks = s.fork(len(DIMENSIONS))
    for f, dim in zip(forks, DIMENSIONS, strict=True):
        f += sgl.user("Judge the essay on " + dim + " in one sentence.")
        f += sgl.assistant(sgl.gen("judgment", max_tokens=64, stop="\n"))
    forks.join()
    s += sgl.user("Judgments:\n" + "\n".join(s["judgment"]) + "\nSummarize and grade the essay as JSON.")
    s += sgl.assistant(sgl.gen("result", max_tokens=96, regex=RESULT_REGEX))


if __name__ == "__main__":
    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    state = essay_judge.run(image_path="essay.png", essay="A cat sleeps on a warm windowsill.")
    print(state["related"], state["judgment"], state["result"])
