"""Pushing weights to a real vLLM OpenAI server with ServerWeightSender over the "polyfsdp_cpu"
backend (trainer/rollout/servers/): after a push the server's own /v1/completions computes the pushed
model's log-probs (prompt and sampled tokens, fp32, to 1e-5) and greedy tokens; a push missing a
bucket fails naming the layers it left out; a refused request is one line naming the server and the route.
One server for the module (starting one takes ~30 s)."""
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from polyfsdp.trainer.data.tokenizers import CharTokenizer
from polyfsdp.trainer.rollout.servers import gloo_wire
from polyfsdp.trainer.rollout.servers.http import ServerError
from polyfsdp.trainer.rollout.servers.weight_sender import ServerWeightSender
from tests.helpers.vllm_cases import require_vllm, write_checkpoint
from tests.helpers.vllm_server import free_port, get_json, post_json, running_server

TOK = CharTokenizer()
PRESET = "qwen2-tiny"
PROMPT = [TOK.bos_token_id] + TOK.encode("abc=dcba+")
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    root = tmp_path_factory.mktemp("server")
    model_dir = write_checkpoint(root / "seed0", PRESET, TOK, seed=0)
    with running_server(model_dir, root / "server.log") as url:
        yield url, model_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``seed -> HF model`` of the server's architecture with other weights."""
    built = {}

    def get(seed):
        if seed not in built:
            path = write_checkpoint(tmp_path_factory.mktemp(f"seed{seed}"), PRESET, TOK, seed=seed)
            built[seed] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return built[seed]

    return get


def layer_buckets(model):
    """One bucket per decoder layer, one before (embeddings) and one after (final norm, head)."""
    buckets = {}
    for name, param in model.named_parameters():
        key = name.split(".")[2] if name.startswith("model.layers.") else ("post" if buckets else "pre")
        buckets.setdefault(key, []).append((name, param.detach()))
    return list(buckets.values())


def server_scores(url, model_dir):
    """The server's greedy completion of PROMPT and its log-probs of every prompt token after the first
    and of every sampled token."""
    reply = post_json(url + "/v1/completions", {
        "model": model_dir, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "prompt_logprobs": 0, "return_token_ids": True,
        "return_tokens_as_token_ids": True})["choices"][0]
    prompt_lp = [entry[str(tok)]["logprob"] for tok, entry in zip(PROMPT[1:], reply["prompt_logprobs"][1:])]
    return reply["token_ids"], torch.tensor(prompt_lp + reply["logprobs"]["token_logprobs"], dtype=torch.float64)


@torch.no_grad()
def hf_scores(model):
    """The same as ``server_scores``, from the HF model in this process."""
    ids = list(PROMPT)
    for _ in range(MAX_TOKENS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    return ids[len(PROMPT):], logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def assert_serves(url, model_dir, model):
    tokens, logprobs = server_scores(url, model_dir)
    want_tokens, want_logprobs = hf_scores(model)
    assert tokens == want_tokens
    assert (logprobs - want_logprobs).abs().max() < 1e-5


def nbytes(buckets):
    return sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)


def push(url, buckets, version):
    sender = ServerWeightSender([url], [1], is_sender=True, timeout_s=60)
    sender.init()
    try:
        return sender.push(buckets, version)
    finally:
        sender.close()


def test_wire_round_trip_over_a_standalone_gloo_group():
    """No vLLM: a bucket of mixed dtypes (bf16 too, which gloo cannot broadcast as such) packs into
    one buffer that a second rank receives and unpacks bitwise; ranks other than the sender only
    iterate the buckets (their gathers are collectives) and send nothing."""
    tensors = [torch.randn(3, 5).bfloat16(), torch.randn(7), torch.tensor(2.5, dtype=torch.float64),
               torch.arange(5, dtype=torch.int8)]
    names, shapes = [gloo_wire.dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors]
    buffer = gloo_wire.pack(tensors)
    assert buffer.numel() == gloo_wire.packed_size(names, shapes) == 32 + 32 + 16 + 16
    store = gloo_wire.master_store("127.0.0.1", 0, 30)
    received = torch.empty_like(buffer)

    def worker():
        group = gloo_wire.join_group(None, "127.0.0.1", store.port, 1, 2, 30)
        gloo_wire.broadcast(group, received).wait()
        group.shutdown()

    thread = threading.Thread(target=worker)
    thread.start()
    group = gloo_wire.join_group(store, "127.0.0.1", store.port, 0, 2, 30)
    gloo_wire.broadcast(group, buffer).wait()
    thread.join()
    group.shutdown()
    for sent, got in zip(tensors, gloo_wire.unpack(received, names, shapes)):
        assert got.dtype == sent.dtype and torch.equal(got, sent)

    iterated = []
    other_rank = ServerWeightSender(["http://127.0.0.1:1"], [1], is_sender=False)
    other_rank.init()  # no-op off the sender
    assert other_rank.push((iterated.append(i) or [("w", torch.ones(1))] for i in range(3)), 1) == 0
    assert iterated == [0, 1, 2]


def test_push_makes_the_server_compute_the_pushed_model(server, models):
    url, model_dir = server
    with pytest.raises(AssertionError):
        assert_serves(url, model_dir, models(1))  # seed 0 on the server: the check can tell them apart
    sender = ServerWeightSender([url], [1], is_sender=True, timeout_s=60)
    sender.init()
    try:
        for version, seed in ((1, 1), (2, 2)):
            buckets = layer_buckets(models(seed))
            start = time.perf_counter()
            sent = sender.push(buckets, version)
            print(f"push {version}: {sent} bytes in {len(buckets)} buckets, {time.perf_counter() - start:.3f} s")
            assert sent == nbytes(buckets)  # every tensor is a multiple of the 16-byte alignment here
            assert_serves(url, model_dir, models(seed))
            assert get_json(url + "/weight_info")["weight_version"] == str(version)
    finally:
        sender.close()


def test_a_push_missing_a_bucket_fails_naming_the_layers_it_left_out(server, models):
    """The workers check at the end of a push that every layer got its weights: one missing a bucket
    fails, naming its layers, and leaves the server paused. What it holds then: the weights those
    layers had (vLLM's reload keeps them), the new ones elsewhere; the log-prob check tells that mix
    from the pushed model."""
    url, model_dir = server
    push(url, layer_buckets(models(2)), 2)
    buckets = layer_buckets(models(3))
    dropped = buckets.pop(1)  # decoder layer 0
    with pytest.raises(ServerError, match=r"POST /update_weights: .* of vLLM's layers got none or only part of their "
                                          r"weights: model.layers.0.self_attn.qkv_proj \(0 of \d+ elements\)") as err:
        push(url, buckets, 3)
    assert "\n" not in str(err.value)
    assert get_json(url + "/is_paused")["is_paused"] is True
    post_json(url + "/resume", None)  # to look at what it holds
    with pytest.raises(AssertionError):
        assert_serves(url, model_dir, models(3))
    mix = AutoModelForCausalLM.from_config(models(3).config, dtype=torch.float32).eval()
    mix.load_state_dict({**models(3).state_dict(), **{n: models(2).get_parameter(n) for n, _ in dropped}})
    assert_serves(url, model_dir, mix)


def test_a_refused_request_is_one_line_naming_server_and_route(server, models):
    url, model_dir = server
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError) as refused:
        ServerWeightSender([closed], [1], is_sender=True, timeout_s=10).init()
    message = str(refused.value)
    assert "\n" not in message and closed in message and "/init_weight_transfer_engine" in message

    with pytest.raises(ServerError) as missing:
        ServerWeightSender([url + "/nope"], [1], is_sender=True, timeout_s=10).init()
    assert "\n" not in str(missing.value) and f"({url}/nope) POST /init_weight_transfer_engine" in str(missing.value)
    assert "HTTP 404" in str(missing.value)

    # The server refuses a bucket naming no parameter of its model: the push raises the server's own
    # error text, and the server stays paused (nothing samples from a half-synced model) ...
    sender = ServerWeightSender([url], [1], is_sender=True, timeout_s=60)
    sender.init()
    try:
        with pytest.raises(ServerError) as bad:
            sender.push([[("model.no_such.weight", torch.zeros(4))]], 9)
        print("server's refusal:", bad.value)
        assert "\n" not in str(bad.value) and "/update_weights" in str(bad.value) and url in str(bad.value)
        assert get_json(url + "/is_paused")["is_paused"] is True
    finally:
        sender.close()
    # ... until a later push from a fresh sender goes through.
    push(url, layer_buckets(models(1)), 10)
    assert_serves(url, model_dir, models(1))


def test_nccl_sender_speaks_vllms_nccl_init_info(monkeypatch):
    """The GPU path cannot run here; this checks only that its worker init payload is what vLLM's NCCL
    worker engine parses (the rest is vLLM's own trainer endpoint)."""
    require_vllm()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from polyfsdp.backends.cuda import VllmNcclSender

    info = NCCLWeightTransferEngine.init_info_cls(**VllmNcclSender("127.0.0.1", 0, 3).worker_init_info(2))
    assert (info.rank_offset, info.world_size, info.packed) == (2, 3, False) and info.master_port > 0


def test_one_broadcast_reaches_two_servers(server, models, tmp_path):
    """A second server joins the same group (ranks 1 and 2): every bucket is broadcast once and both
    servers then compute the pushed model."""
    url, model_dir = server
    with running_server(model_dir, tmp_path / "second.log") as second:
        sender = ServerWeightSender([url, second], [1, 1], is_sender=True, timeout_s=60)
        assert sender.rank_offsets == [1, 2] and sender.world_size == 3
        sender.init()
        try:
            buckets = layer_buckets(models(4))
            assert sender.push(buckets, 4) == nbytes(buckets)
        finally:
            sender.close()
        for each in (url, second):
            assert_serves(each, model_dir, models(4))
            assert get_json(each + "/weight_info")["weight_version"] == "4"
