"""A scripted model for the turn engines' tests: each prompt's `Script` is the text it writes, on a character
tokenizer."""

from helpers.testing_utils import make_char_tokenizer

TOKENIZER = make_char_tokenizer(extra_chars="#")


EOS = TOKENIZER.eos_token_id


def ids_of(text):
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class Script:
    """One completion's text, emitted token by token from where the sequence stands, stopping as vLLM does: at the
    token that completes any stop string asked for, at the budget, or with EOS after the last token."""

    def __init__(self, prompt, text):
        self.prompt, self.ids, self.requests = list(prompt), ids_of(text), []

    def turn(self, sequence, max_tokens, stops):
        self.requests.append(list(stops))
        # What the model wrote so far is the sequence's tokens minus the prompt and the interpreter blocks.
        written = [t for t in sequence[len(self.prompt) :]]
        text = TOKENIZER.decode(written)
        while "<interpreter>" in text:
            head, _, rest = text.partition("<interpreter>")
            text = head + rest.partition("</interpreter>")[2]
        cursor, out = len(ids_of(text)), []
        while len(out) < max_tokens:
            if cursor >= len(self.ids):
                out.append(EOS)
                break
            out.append(self.ids[cursor])
            cursor += 1
            if any(stop in TOKENIZER.decode(out) for stop in stops):
                break
        return out
