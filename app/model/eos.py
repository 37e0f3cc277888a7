"""The ids that end a generation. Apart from the runner: the ingress reads them and never loads a model
(transformers' modeling modules take seconds to import in every replica that starts)."""


def tokenizer_eos_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's end-of-sequence id(s)."""
    eos = tokenizer.eos_token_id
    return frozenset(eos if isinstance(eos, list) else [eos]) - {None}


def eos_ids(generation_config, tokenizer) -> frozenset[int]:
    """The ids that end generation, as `generate` and vLLM stop on them: the generation config's (often
    a list on chat models: Llama-3.1-Instruct's <|eom_id|> and <|eot_id|>, Gemma's <end_of_turn>) and
    the tokenizer's own."""
    ids = set(tokenizer_eos_ids(tokenizer))
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return frozenset(ids - {None})
