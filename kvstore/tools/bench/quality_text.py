"""The text ``kvstore bench quality`` measures on: chat prompts written for it, and this project's
own docs (text the model was not tuned on) for perplexity."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from kvstore.engine.checkpoint import CheckpointError, checkpoint_dir
from kvstore.services.engine_server.tokenizer import ServeTokenizer, load_tokenizer
from kvstore.tools.bench.harness import DOCS
from kvstore.tools.bench.models import BenchModel

# The perplexity text: these docs in this order, concatenated until there are enough tokens.
# The pages this benchmark or its results rewrite (benchmarks.md, storage-format.md,
# architecture.md) are left out, so that writing the results does not change the text.
DOC_FILES = ("key-format.md", "protocol.md", "eviction.md", "kv-events.md", "routing.md", "remote.md",
             "engine.md", "serving.md", "vllm.md", "kernels.md", "rest.md")
PROMPTS = (  # 40-52 words each; SmolLM2's template (its system prompt added) makes 75-96 tokens of them
    "My grandmother kept a notebook of recipes in pencil, and most pages are fading. I would like to keep "
    "them for my children, who live in three different countries. What is a sensible way to copy, store and "
    "share about sixty handwritten recipes without losing the notes she wrote in the margins?",
    "I am planting a small vegetable garden on a balcony that faces west and gets about five hours of direct "
    "sun in the afternoon. The pots are 30 centimetres deep and I water them in the evening. Which three "
    "vegetables would you pick for a first season, and why those?",
    "Write a short story opening, about six sentences long, in which a lighthouse keeper on a small island "
    "finds a message in a bottle and slowly realises that it was written by his own grandfather sixty years "
    "earlier, on the same rocks where he is standing.",
    "I keep mixing up lists and tuples in Python. Explain the difference between them, when each one is the "
    "better choice, and show a small example where using a tuple as a dictionary key works while a list "
    "would raise an error.",
    "A regional train leaves the station at 9:40 in the morning and travels 180 kilometres at an average "
    "speed of 72 kilometres per hour, with one stop of ten minutes on the way. At what time does it arrive? "
    "Show each step of your reasoning.",
    "Our neighbour's dog barks for long stretches after eleven at night, and we have a newborn who wakes up "
    "every time. We have never spoken to the neighbour before. Write a short, polite and friendly note that "
    "asks for help without sounding like a complaint.",
    "Describe how a refrigerator keeps food cold, in terms a ten-year-old could follow. Mention what the "
    "liquid in the pipes does, why the back of the fridge feels warm, and why leaving the door open does "
    "not cool down the kitchen.",
    "I bought a laptop last month and want its battery to stay healthy for at least five years. I mostly use "
    "it at a desk plugged in, but sometimes travel with it for a week. List four habits that actually make "
    "a difference, and one common belief that does not.",
    "My sourdough bread comes out dense and flat. The starter doubles in about six hours and smells "
    "pleasantly sour, I use 75 percent hydration, shape the loaf after a four-hour bulk rise in a cold "
    "kitchen, and bake it at 230 degrees in a covered pot. What could be going wrong?",
    "Give a brief overview of how vaccines train the immune system to recognise a virus. Cover what the "
    "vaccine contains, what the body does in the first weeks after the shot, and why some vaccines need a "
    "second dose or a booster later on.",
    "Translate the following paragraph into French and explain any word choice that is not literal: 'The "
    "meeting was pushed back to Thursday because half of the team was stuck in traffic after the storm. We "
    "will keep the same agenda, but the budget review will come first.'",
    "I live five kilometres from my office, mostly flat, with one busy road to cross. Compare walking, "
    "cycling and taking the bus for this commute every weekday, looking at time, cost, health, safety and "
    "what happens on rainy days, and then make a recommendation.",
    "A colleague left this line in a cleanup script and nobody remembers why: find /var/app -name "
    "'*.log' -mtime +7 -delete. Explain what it does, part by part, what could go wrong if it ran from "
    "the wrong directory, and how to try it safely first.",
    "We are designing a cooperative board game for two to four players about rebuilding a river town after "
    "a flood. Suggest a name, a one-sentence pitch, and three kinds of cards the players could draw during "
    "a turn, with an example of each.",
    "Why do iron railings rust within a few years, while gold jewellery found in ancient tombs still shines? "
    "Explain what happens to the metal at the surface in each case, and say why stainless steel behaves "
    "differently from plain steel. Keep it under two hundred words.",
    "Write a poem of two short stanzas about an old cat watching rain run down a window on a grey Sunday "
    "afternoon, while the house is quiet and someone is baking in the kitchen. It does not need to rhyme.",
    "I have 45 minutes before guests arrive, two eggs, a cup of cooked rice from yesterday, an onion, a "
    "carrot, frozen peas and soy sauce. What can I cook for three people, and in what order should I do "
    "things so that everything is hot at the same time?",
    "Explain what a hash table is to someone who has just learned about arrays. Describe how a key becomes "
    "a position, what happens when two keys land in the same place, and why looking up a key is usually "
    "fast but sometimes is not.",
    "Tomorrow I have the last interview for a junior software developer position at a company that builds "
    "tools for hospitals. At the end they will ask whether I have questions for them. Suggest three "
    "questions worth asking, and say what each answer would tell me.",
    "Describe the water cycle for a school poster, in five numbered steps, starting from the ocean on a "
    "warm day, going through the clouds and the mountains, and ending back at the sea. Each step should be "
    "one or two sentences long.",
)




def text_tokenizer(model: BenchModel) -> ServeTokenizer:
    """The tokenizer and chat template ``kvstore engine`` serves the model with (bytes for the
    random model), read before any engine is built: the stores are sized from the prompts.

    Raises:
        CheckpointError: the model cannot be read.
    """
    if model.path is None:
        return load_tokenizer(None, None)
    from tokenizers import Tokenizer

    root = checkpoint_dir(model.path)
    if not (root / "tokenizer.json").is_file():
        raise CheckpointError(f"{model.path} has no tokenizer.json: the benchmark needs its tokenizer")
    return load_tokenizer(model.path, Tokenizer.from_file(str(root / "tokenizer.json")))


def chat_prompts(served: ServeTokenizer, num_prompts: int) -> list[list[int]]:
    """The first ``num_prompts`` of PROMPTS, each a user message rendered by the chat template."""
    return [served.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS[:num_prompts]]


def doc_tokens(encode: Callable[[str], list[int]], num_tokens: int,
               docs: Path = DOCS) -> tuple[list[int], list[str], str]:
    """The first ``num_tokens`` tokens of ``DOC_FILES`` concatenated, the files used and the
    sha256 of their concatenation (the text those tokens are the start of)."""
    text, used = "", []
    for name in DOC_FILES:
        text += (docs / name).read_text(encoding="utf-8")
        used.append(name)
        tokens = encode(text)
        if len(tokens) >= num_tokens:
            return tokens[:num_tokens], used, hashlib.sha256(text.encode("utf-8")).hexdigest()
    raise ValueError(f"{', '.join(DOC_FILES)} give {len(tokens)} tokens, fewer than the {num_tokens} asked for")
