"""Draft/target compatibility: the draft must speak the target's vocabulary token for token."""

from app.errors import VocabularyMismatchError


def check_vocabularies(target_tokenizer, draft_tokenizer) -> None:
    """Raise VocabularyMismatchError naming the first ids whose tokens differ.

    Embedding matrices padded past the tokenizer (vocab sizes that differ only by padding rows)
    are fine: the runners slice logits to the tokenizer's length.
    """
    target, draft = _by_id(target_tokenizer), _by_id(draft_tokenizer)
    diffs = [i for i in range(max(len(target), len(draft))) if target.get(i) != draft.get(i)]
    if diffs:
        shown = ", ".join(f"id {i}: target {target.get(i)!r} vs draft {draft.get(i)!r}" for i in diffs[:3])
        raise VocabularyMismatchError(
            f"draft and target vocabularies differ at {len(diffs)} ids ({shown}); "
            "use a draft trained with the target's tokenizer")


def _by_id(tokenizer) -> dict[int, str]:
    return {i: tok for tok, i in tokenizer.get_vocab().items()}
