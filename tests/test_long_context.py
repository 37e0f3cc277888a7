"""A 16k-token prompt through the draft and the target, in process: chunked on both, within the memory
model's budget (app/model/memory.py), measured as the process's peak resident memory in a fresh process."""

import json
import subprocess
import sys
import textwrap

import pytest

PROMPT_TOKENS = 16_384


@pytest.mark.slow
def test_a_16k_prompt_stays_within_the_memory_model(tmp_path):
    script = textwrap.dedent(f"""
        import json, os, sys, threading
        import torch
        sys.path.insert(0, "tests")
        from conftest import make_tokenizer
        from transformers import LlamaConfig, LlamaForCausalLM
        from app.speculation.driver import DraftPolicy
        from app.engine import Engine, EngineSettings
        from app.model.memory import ForwardSize, working_bytes
        from app.params import SamplingParams
        from app.model.runner import ModelRunner

        torch.manual_seed(0)
        torch.set_num_threads(2)
        def model(layers):
            cfg = LlamaConfig(vocab_size=98, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings={PROMPT_TOKENS + 64},
                              bos_token_id=0, eos_token_id=1)
            return LlamaForCausalLM(cfg).eval()
        tok = make_tokenizer()
        target, draft = ModelRunner(model(4), tok), ModelRunner(model(1), tok, max_forward_tokens=512)
        engine = Engine(target, draft, EngineSettings(prefill_chunk=512, policy=DraftPolicy(timeout_s=600)))
        prompt = torch.randint(2, 98, ({PROMPT_TOKENS},), generator=torch.Generator().manual_seed(1)).tolist()
        engine.generate([prompt[:600]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm up
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        before, peak, running = rss(), [0], [True]
        def sample():  # the resident size's peak while the request runs (a miss only lowers it)
            while running[0]:
                peak[0] = max(peak[0], rss())
                threading.Event().wait(0.002)
        sampler = threading.Thread(target=sample)
        sampler.start()
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                       speculation={{"num_tokens": 4}}))[0]
        running[0] = False
        sampler.join()
        after = rss()
        model_bytes, kv_bytes = 0, 0
        for r in (target, draft):
            kv = r.kv_block_bytes() * -(-({PROMPT_TOKENS} + 16) // 16)
            kv_bytes += kv
            work = working_bytes(r.model.config, r.model.dtype, r.vocab_size, ForwardSize(512 + 8, {PROMPT_TOKENS} + 16),
                                 attention=r.attention_path, device_type="cpu")  # a chunk + K
            model_bytes += kv + work
        print(json.dumps({{"peak": max(peak[0], after) - before, "kept": after - before, "model": model_bytes,
                           "kv": kv_bytes, "emitted": len(out.token_ids),
                           "drafted": out.speculation["drafted_tokens"]}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["emitted"] == 8 and figures["drafted"] > 0
    # the process keeps at least the KV it wrote (the pools' written blocks stay resident), and at its
    # peak grew by no more than the memory model says the two models' KV and forwards take
    assert figures["kv"] <= figures["kept"] <= figures["peak"] <= figures["model"], figures
