"""A user environment kept outside polyfsdp (tests load it by path): the assistant guesses a
letter; the environment says "higher" or "lower" until it is right (reward 1) or turns run out."""


class GuessEnv:
    tools = []

    def __init__(self, target: str = "e"):
        self.target = target

    def reset(self, example):
        return [{"role": "user", "content": "guess a letter"}]

    def step(self, assistant_text):
        guess = assistant_text.strip()[:1]
        if guess == self.target:
            return [], 1.0, True
        return [{"role": "user", "content": "higher" if guess < self.target else "lower"}], 0.0, False
