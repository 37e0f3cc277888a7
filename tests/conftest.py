"""Tiny Llama models and a tokenizer built from configs: nothing is downloaded."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from app.model.runner import ModelRunner

VOCAB = 98  # the tokenizer: printable ASCII, newline, <s> and </s>


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII, with <s> and </s>."""
    vocab = {"<s>": 0, "</s>": 1}
    for c in map(chr, range(32, 127)):
        vocab[c] = len(vocab)
    vocab["\n"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def make_byte_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (what real checkpoints use, and what grammar libraries read), trained
    on a few lines of JSON and code: every byte is a token, and common pairs merge."""
    corpus = ['{"name": "ada", "age": 36, "admin": true}', '[1, 2, 3], {"a": null, "b": false}',
              "def f(x):\n    return x + 1", '{"items": ["x", "y"], "count": 2}'] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def make_model(seed: int, layers: int = 2, hidden: int = 64, vocab_rows: int = VOCAB,
               max_positions: int = 256) -> LlamaForCausalLM:
    """A random tiny Llama; logits scaled up so its distributions are peaked like a trained model's."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_rows, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def blend(target: LlamaForCausalLM, seed: int, weight: float) -> LlamaForCausalLM:
    """A draft that partially agrees with the target: its weights mixed with a random model's."""
    draft = make_model(seed, vocab_rows=target.config.vocab_size)
    with torch.no_grad():
        for pd, pt in zip(draft.parameters(), target.parameters()):
            pd.mul_(1 - weight).add_(pt, alpha=weight)
    return draft


def _deploys_app(item) -> bool:
    """Whether `item`'s module deploys the app on the session's cluster (tests/serving.py)."""
    import serving

    module = getattr(item, "module", None)
    return (getattr(module, "running_app", None) is serving.running_app
            or getattr(module, "shared_cluster", None) is serving.shared_cluster)


def pytest_collection_modifyitems(items):
    """The modules that deploy the app run last, one after another, on one cluster (tests/serving.py)."""
    items.sort(key=_deploys_app)  # stable: each module's tests keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test on the shared cluster (its fixtures torn down, its app deleted), stop it."""
    result = yield
    if nextitem is None or not _deploys_app(nextitem):
        import serving

        serving.stop_shared_cluster()
    return result


def pytest_sessionfinish(session):
    import serving

    serving.stop_shared_cluster()


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def target_model():
    return make_model(seed=1)


@pytest.fixture()
def target_runner(target_model, tokenizer):
    return ModelRunner(target_model, tokenizer)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, target_model, tokenizer):
    """The target and a partially agreeing draft saved in Hugging Face format, for from_pretrained."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, model in {"target": target_model, "draft": blend(target_model, 7, 0.85)}.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def kv_store(blocks: int, on_drop=lambda seq_id: None):
    """A KV store over a pool of `blocks` blocks of one layer, one head of width 2 (for the store's own tests)."""
    from app.model.kv import KVStore

    probe = KVStore(1 << 30)
    probe.configure(1, 1, 2, torch.float32, torch.device("cpu"))
    store = KVStore(blocks * probe.block_bytes, on_drop=on_drop)
    store.configure(1, 1, 2, torch.float32, torch.device("cpu"))
    return store


def put_ids(store, seq_id: str, ids, salt: str | None = None):
    """Store a sequence of these token ids (its KV left unwritten: the store's bookkeeping alone)."""
    from app.model.kv import SequenceCache

    entry = SequenceCache(list(ids))
    store.reserve(entry, 0, len(entry), frozenset({seq_id}))
    store.put(seq_id, entry, salt)
    return entry
