"""Session: the Python face of the C++ runtime. It owns the text side (tokenizer, chat
template, stop strings) and an engine thread (EngineLoop) that drives the C++ engine in token
ids, with the GIL released while C++ runs; generate(), stream() and astream() submit to it from
any thread."""

from __future__ import annotations

import asyncio
import os
import queue
import secrets
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from dflash import _core
from dflash.default_model import default_model_dir, resolve_draft
from dflash.engine_loop import EngineLoop
from dflash.outputs import RequestOutput, metrics_from_core
from dflash.params import SamplingParams
from dflash.streaming import (AsyncRequestStream, RequestStream, StreamSink, abort_when_submitted, async_put,
                              blocking_put)
from dflash.text_stream import TextStream
from dflash.tokenizer import Tokenizer

Message = Dict[str, Any]
PromptLike = Union[str, Sequence[int], Sequence[Message]]

# Keyword arguments of Session beyond the named ones, with their C++ config field.
_RUNTIME_KWARGS = {
    "gpu_memory_utilization": "gpu_memory_utilization",
    "block_size": "block_size",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "num_threads": "num_threads",
    "cuda_graphs": "cuda_graphs",
    "async_decode": "async_decode",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "enable_prefix_caching": "enable_prefix_caching",
    "speculation": "speculation",
    "draft_lengths": "draft_lengths",
    "spec_cost_table": "spec_cost_table",
    "deterministic": "batch_invariant",
}


@dataclass
class _Prompt:
    text: Optional[str]
    token_ids: List[int]


class _GenerateSink:
    """Engine-thread end of one generate() request: stop strings through TextStream, and the
    finished RequestOutput (with the raw result) handed to the waiting generate() call."""

    def __init__(self, index: int, prompt: _Prompt, text: TextStream,
                 make_output: Callable[[_Prompt, TextStream, Any], RequestOutput],
                 put: Callable[[Any], None]) -> None:
        self.request_id = -1
        self._index = index
        self._prompt = prompt
        self._text = text
        self._make_output = make_output
        self._put = put

    def on_tokens(self, token_ids: Sequence[int]) -> bool:
        self._text.push(token_ids)
        return self._text.stopped

    def on_finish(self, result: Any) -> None:
        self._put((self._index, self._make_output(self._prompt, self._text, result), result))

    def on_error(self, error: Exception) -> None:
        self._put(error)


# Bound of the integer options (the C++ side holds them in 32/64-bit integers).
_INT32_MAX = 2**31 - 1


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value > _INT32_MAX:
        raise ValueError(f"{name}={value} is too large (at most {_INT32_MAX})")
    return value


def _resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "auto":
        return "cuda" if _core.cuda_usable() else "cpu"
    return device


class Session:
    """A loaded model ready to generate.

    Session(model_dir=None, *, draft=None, device="auto", max_model_len=None, kv_cache_tokens=None,
            **kwargs)

    model_dir: a Hugging Face model directory (config.json, *.safetensors, tokenizer.json); None:
        the default model (SmolLM2-135M-Instruct, fetched and converted once into the user cache,
        as `dflash generate` without --model does).
    draft: a DFlash drafter directory (z-lab DFlashDraftModel format): generation then uses
        speculative decoding (lossless: greedy output equals the target's greedy output,
        sampling follows the target's distribution). "default": the drafter shipped for the
        default model; "none": no drafter. Unset (None): with the default model, the shipped
        drafter on CUDA and none on the CPU; with a model_dir, none (`dflash generate --draft`
        follows the same rule).
    num_speculative_tokens: draft tokens per step, 1..block_size-1 (default block_size-1).
    draft_sampling: DFlash (v1) drafts: "probabilistic" (at temperature > 0 each draft is sampled
        from the drafter's softmax(logits / T) on its own random stream and verified by exact
        rejection sampling against that distribution; the argmax at T = 0), "greedy" (the argmax
        of each draft row at every temperature, verified as one-hot proposals) or "auto"
        (default: probabilistic, which accepts more drafts at T > 0). DFlash2 drafters walk their
        candidates: "auto" (default) samples the walk at T > 0 (q = the walked rows), "greedy"
        takes the argmax walk at every temperature (one-hot proposals); at T = 0 both are the
        greedy walk. "probabilistic" with a DFlash2 drafter is a ValueError.
        `stats()["draft_sampling"]` names what runs ("walk" or "greedy_walk" for DFlash2).
    draft_head: which copy of the target's LM head the drafter drafts on: "exact" (default) or
        "fp8" (an FP8 e4m3 copy with one scale per vocabulary row, made once at load, which reads
        half the bytes per draft step and adds V x H bytes of weights). A DFlash (v1) drafter
        then takes its drafts from the FP8 logits (their argmax, or with probabilistic drafts the
        draw and its proposal q, which stay the distribution the draft came from); a DFlash2
        drafter picks each slot's K candidates on it and re-scores and re-sorts them with the
        exact head, so its selector scores stay exact. Verification always uses the exact head,
        so output stays lossless either way: greedy output equals the target's, sampling keeps
        the target's distribution; only acceptance may change. "fp8" without a drafter is a
        ValueError.
    device: "cpu", "cuda" or "auto" (CUDA when this build has it, else the CPU).
    max_model_len: longest prompt + generation (default: the model's max_position_embeddings).
    kv_cache_tokens: size of the paged KV cache in tokens (default: from max_model_len and
        memory).
    kwargs: block_size, max_num_seqs, max_num_batched_tokens, num_threads (CPU),
        gpu_memory_utilization (CUDA: fraction of GPU memory for weights, workspaces and the KV
        cache, default 0.9), cuda_graphs (CUDA: decode steps replay CUDA graphs captured at
        start-up, one per padded batch size; default True, False runs them eagerly; True on the
        CPU is a ValueError), async_decode (default False: pipelined decoding, target-only or
        speculative; each step launches the next before reading its own outputs, which the next
        step takes on the device (the tokens; with a drafter the accepted count and the next
        token), so host work between steps overlaps the device; outputs are the same; a request
        that ends costs one dropped row; with speculation="adaptive" a pipelined step's draft
        length is chosen before the acceptance of the step in flight is known), enable_chunked_prefill
        (default True: a prompt longer than max_num_batched_tokens, the prefill tokens per step,
        is prefilled in chunks over several steps while running requests keep decoding; False
        prefills each prompt in one step), enable_prefix_caching (default True: full KV blocks
        of prompts and generated tokens are kept, keyed by the hash of their whole prefix, and a
        request whose prompt starts with cached blocks shares them instead of computing them
        again, the drafter's context included; blocks no request uses are evicted least recently
        used first, only when the cache needs room; outputs are the same; requests recording
        prompt logits or taps compute every row), speculation (with a draft model: "fixed", the
        default, drafts num_speculative_tokens in every decode step; "adaptive" picks per step one draft
        length for the batch from draft_lengths, 0 being a plain AR step, to maximise the expected
        tokens per second from step costs measured at start-up and each request's running
        acceptance by draft position, so speculation stops when it does not pay under load; output
        stays lossless, but at temperature > 0 a seeded request's tokens then depend on the draft
        lengths chosen, i.e. on the load, where "fixed" gives the same tokens alone or batched;
        stats()["spec_cost_table"] and ["spec_length_steps"] show the costs and the choices),
        draft_lengths (speculation="adaptive": the draft lengths with decode programs, captured
        per length and batch size on CUDA; default 0, 1, 3, 7, ... and num_speculative_tokens, which
        are always included), spec_cost_table (speculation="adaptive": the step costs to use instead
        of measuring them at start-up, as stats()["spec_cost_table"] gives them: {"batch_sizes",
        "lengths", "seconds"}; its lengths are the draft lengths, so draft_lengths is not passed with
        it), deterministic (CUDA, default False: batch-invariant kernels, so a position's logits
        have the same bits whether it is decoded alone, in a batch, in a speculative verify step
        or in a prefill, and greedy speculative decoding emits exactly the target-only greedy
        tokens; slower, see the README; True on the CPU is a ValueError; stats()["deterministic"]
        says which ran). Unknown keywords raise TypeError.
    """

    def __init__(
        self,
        model_dir: Optional[Union[str, os.PathLike]] = None,
        *,
        draft: Optional[Union[str, os.PathLike]] = None,
        num_speculative_tokens: Optional[int] = None,
        draft_sampling: str = "auto",
        draft_head: str = "exact",
        device: str = "auto",
        max_model_len: Optional[int] = None,
        kv_cache_tokens: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(_RUNTIME_KWARGS))
        if unknown:
            raise TypeError(f"Session() got unexpected keyword argument(s): {', '.join(unknown)}")
        config = _core.SessionConfig()
        config.device = _resolve_device(device)
        draft = resolve_draft(draft, default_model=model_dir is None, device=config.device)
        if model_dir is None:
            model_dir = default_model_dir()
        model_dir = os.fspath(model_dir)
        if not os.path.isdir(model_dir):
            raise ValueError(f"model directory not found: {model_dir}")
        for name, value in (("max_model_len", max_model_len), ("kv_cache_tokens", kv_cache_tokens)):
            if value is not None:
                setattr(config, name, _positive_int(name, value))
        if draft is not None:
            if not os.path.isdir(draft):
                raise ValueError(f"draft model directory not found: {draft}")
            config.draft_dir = draft
        if draft_sampling not in ("auto", "greedy", "probabilistic"):
            raise ValueError(f"draft_sampling must be 'auto', 'greedy' or 'probabilistic', got {draft_sampling!r}")
        if draft_sampling == "probabilistic" and draft is None:
            raise ValueError("draft_sampling='probabilistic' needs a draft model (draft=...)")
        config.draft_sampling = draft_sampling
        if draft_head not in ("exact", "fp8"):
            raise ValueError(f"draft_head must be 'exact' or 'fp8', got {draft_head!r}")
        if draft_head != "exact" and draft is None:
            raise ValueError("draft_head='fp8' needs a draft model (draft=...)")
        config.draft_head = draft_head
        if num_speculative_tokens is not None:
            if draft is None:
                raise ValueError("num_speculative_tokens needs a draft model (draft=...)")
            if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                    or num_speculative_tokens < 1:
                raise ValueError(f"num_speculative_tokens must be a positive integer, got {num_speculative_tokens!r}")
            config.num_speculative_tokens = num_speculative_tokens
        utilization = kwargs.pop("gpu_memory_utilization", None)
        if utilization is not None:
            if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
            config.gpu_memory_utilization = float(utilization)
        async_decode = kwargs.pop("async_decode", None)
        if async_decode is not None:
            if not isinstance(async_decode, bool):
                raise ValueError(f"async_decode must be True or False, got {async_decode!r}")
            config.async_decode = async_decode
        chunked = kwargs.pop("enable_chunked_prefill", None)
        if chunked is not None:
            if not isinstance(chunked, bool):
                raise ValueError(f"enable_chunked_prefill must be True or False, got {chunked!r}")
            config.enable_chunked_prefill = chunked
        prefix = kwargs.pop("enable_prefix_caching", None)
        if prefix is not None:
            if not isinstance(prefix, bool):
                raise ValueError(f"enable_prefix_caching must be True or False, got {prefix!r}")
            config.enable_prefix_caching = prefix
        speculation = kwargs.pop("speculation", None)
        if speculation is not None:
            if speculation not in ("fixed", "adaptive"):
                raise ValueError(f"speculation must be 'fixed' or 'adaptive', got {speculation!r}")
            config.speculation = speculation
        lengths = kwargs.pop("draft_lengths", None)
        if lengths is not None:
            if isinstance(lengths, (str, bytes)) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths):
                raise ValueError(f"draft_lengths must be a list of integers >= 0, got {lengths!r}")
            config.draft_lengths = [int(n) for n in lengths]
        costs = kwargs.pop("spec_cost_table", None)
        if costs is not None:
            try:
                rows = [[float(b), *map(float, row)]
                        for b, row in zip(costs["batch_sizes"], costs["seconds"], strict=True)]
                table_lengths = [int(n) for n in costs["lengths"]]
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError("spec_cost_table must be a dict of batch_sizes [S], lengths [N] and seconds [S][N] "
                                 f"(as stats()['spec_cost_table']): {e}") from None
            if lengths is not None:
                raise ValueError("spec_cost_table names its draft lengths; pass it or draft_lengths, not both")
            config.draft_lengths = table_lengths
            config.spec_cost_table = rows
        graphs = kwargs.pop("cuda_graphs", None)
        if graphs is not None:
            if not isinstance(graphs, bool):
                raise ValueError(f"cuda_graphs must be True or False, got {graphs!r}")
            if graphs and config.device != "cuda":
                raise ValueError("cuda_graphs=True needs device='cuda' (CUDA graphs do not exist on the CPU)")
            config.cuda_graphs = graphs
        deterministic = kwargs.pop("deterministic", None)
        if deterministic is not None:
            if not isinstance(deterministic, bool):
                raise ValueError(f"deterministic must be True or False, got {deterministic!r}")
            if deterministic and config.device != "cuda":
                raise ValueError("deterministic=True needs device='cuda' (the CPU backend has no batch-invariant kernels)")
            config.batch_invariant = deterministic
        for name, value in kwargs.items():
            setattr(config, _RUNTIME_KWARGS[name], _positive_int(name, value))
        self.model_dir = model_dir
        self.draft_dir = draft
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        self._core = _core.Session(model_dir, config)
        self.model_config = self._core.model_config
        self._loop = EngineLoop(self._core)
        # Stops the engine thread when this Session is collected or the interpreter exits; the
        # thread holds the loop, never the Session.
        self._finalizer = weakref.finalize(self, self._loop.close)

    # ------------------------------------------------------------------ inputs
    def _to_prompt(self, item: Any) -> _Prompt:
        if isinstance(item, str):
            return _Prompt(item, self.tokenizer.encode(item, add_special_tokens=True))
        if isinstance(item, (list, tuple)) and item and all(isinstance(m, dict) for m in item):
            text = self.tokenizer.apply_chat_template(list(item), add_generation_prompt=True)
            return _Prompt(text, self.tokenizer.encode(text, add_special_tokens=False))
        if isinstance(item, (list, tuple)):
            if not item:
                raise ValueError("a prompt of token ids is empty")
            vocab = self.model_config.vocab_size
            for pos, t in enumerate(item):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(
                        "a prompt given as a list must hold token ids (ints) or chat messages "
                        f"({{'role': ..., 'content': ...}} dicts); element {pos} is {t!r} "
                        f"({type(t).__name__})"
                    )
                if not 0 <= t < vocab:
                    raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {vocab})")
            return _Prompt(None, [int(t) for t in item])
        raise ValueError(
            "each prompt must be a str, a list of token ids, or a list of chat messages "
            f"({{'role': ..., 'content': ...}} dicts); got {type(item).__name__}"
        )

    def _to_prompts(self, prompts: Any) -> List[_Prompt]:
        if isinstance(prompts, str):
            return [self._to_prompt(prompts)]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a str or a list, got {type(prompts).__name__}")
        if prompts and all(isinstance(m, dict) for m in prompts):  # one conversation
            return [self._to_prompt(prompts)]
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            raise ValueError("a flat list of ints is ambiguous: pass [[ids...]] for one prompt")
        return [self._to_prompt(p) for p in prompts]

    def _sampling_config(self, p: SamplingParams) -> Any:
        vocab = self.model_config.vocab_size
        for t in p.stop_token_ids or []:
            if not 0 <= t < vocab:
                raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab})")
        s = _core.SamplingConfig()
        # Clamps keep huge values inside the C++ integer types without changing their meaning:
        # max_tokens is capped by max_model_len anyway and top_k >= vocab keeps every token.
        s.max_tokens = min(int(p.max_tokens), _INT32_MAX)
        s.temperature = float(p.temperature)
        s.top_p = float(p.top_p)
        s.top_k = min(int(p.top_k), vocab)
        s.seed = p.seed if p.seed is not None else secrets.randbits(63)
        s.stop_token_ids = list(p.stop_token_ids or [])
        s.ignore_eos = p.ignore_eos
        return s

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Union[PromptLike, Sequence[PromptLike]],
        params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
    ) -> List[RequestOutput]:
        """Generates for every prompt together (continuous batching); outputs in prompt order.

        prompts: a str, a list of str, a list of token-id lists, or chat messages (a list of
        {"role", "content"} dicts, or a list of such lists), rendered with the model's chat
        template. A str is raw text, tokenized as is: a completion for a base model; an
        instruct model (the default one) wants chat messages, and given a bare question it
        may end its turn at once (empty text). params: one SamplingParams for all prompts, or
        one per prompt.
        """
        return self._generate(prompts, params)

    def _generate(
        self,
        prompts: Any,
        params: Any = None,
        on_finish: Optional[Callable[[int, RequestOutput], None]] = None,
        request_hooks: Optional[Callable[[Any], None]] = None,
        results: Optional[List[Any]] = None,
    ) -> List[RequestOutput]:
        items = self._to_prompts(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            per_prompt = [params] * len(items)
        else:
            try:
                per_prompt = list(params)
            except TypeError:
                per_prompt = None
            if per_prompt is None or not all(isinstance(p, SamplingParams) for p in per_prompt):
                raise ValueError(
                    "params must be a SamplingParams or a list of one per prompt, "
                    f"got {type(params).__name__}"
                )
            if len(per_prompt) != len(items):
                raise ValueError(
                    f"params has {len(per_prompt)} SamplingParams for {len(items)} prompts "
                    "(pass one SamplingParams, or one per prompt)"
                )
        inputs = [self._request_input(prompt, p, request_hooks) for prompt, p in zip(items, per_prompt)]
        if not inputs:
            return []
        finished: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        sinks = [_GenerateSink(i, prompt, TextStream(self.tokenizer, p.stop, incremental=False),
                               self._make_output, finished.put)
                 for i, (prompt, p) in enumerate(zip(items, per_prompt))]
        request_ids = self._wait_submitted(self._engine_loop().submit(inputs, sinks))
        outputs: List[Optional[RequestOutput]] = [None] * len(items)
        try:
            for _ in range(len(items)):
                item = finished.get()
                if isinstance(item, BaseException):
                    raise item
                index, out, result = item
                outputs[index] = out
                if results is not None:
                    results.append(result)
                if on_finish is not None:
                    on_finish(index, out)
        except BaseException:
            # Leave the session as it was: no request of this call stays queued or holds blocks.
            self._loop.abort(request_ids).result()
            raise
        return [o for o in outputs if o is not None]

    def _request_input(self, prompt: _Prompt, params: SamplingParams,
                       request_hooks: Optional[Callable[[Any], None]] = None) -> Any:
        req = _core.RequestInput()
        req.prompt = prompt.token_ids
        req.sampling = self._sampling_config(params)
        if request_hooks is not None:
            request_hooks(req)
        return req

    def _engine_loop(self) -> EngineLoop:
        if self._loop.closed:
            raise ValueError("this Session is closed")
        return self._loop

    def _wait_submitted(self, submitted: "Future[List[int]]") -> List[int]:
        """The ids of submitted requests; if the wait is interrupted (Ctrl-C), they are aborted
        as soon as the engine thread has added them."""
        try:
            return submitted.result()
        except BaseException:
            abort_when_submitted(self._loop, submitted)
            raise

    def _make_output(self, prompt: _Prompt, text: TextStream, result: Any) -> RequestOutput:
        reason = "stop" if text.stopped else result.finish_reason
        return RequestOutput(prompt.text, prompt.token_ids, text.final_text(result.token_ids),
                             text.final_token_ids(result.token_ids), reason, metrics_from_core(result.metrics))

    # ------------------------------------------------------------------ streaming
    def stream(self, prompt: PromptLike, params: Optional[SamplingParams] = None) -> RequestStream:
        """Submits one prompt (a str, a list of token ids, or chat messages) and returns an
        iterator over its StreamOutput items: text and token ids as they become final (a
        multi-byte character is never split; text that could start a stop string is held back
        until decided), then a last item with finish_reason and metrics. The deltas concatenate
        to what generate() returns. A refused request raises ValueError here. Close the stream
        (or use it in a `with` block) to abort a request that is not read to its end."""
        return self._stream(prompt, params)

    def _stream(self, prompt: Any, params: Optional[SamplingParams] = None,
                request_hooks: Optional[Callable[[Any], None]] = None) -> RequestStream:
        item, req, text = self._stream_request(prompt, params, request_hooks)
        items: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        sink = StreamSink(text, blocking_put(items))
        request_id = self._wait_submitted(self._engine_loop().submit([req], [sink]))[0]
        return RequestStream(self, self._loop, request_id, item.token_ids, items)

    def astream(self, prompt: PromptLike, params: Optional[SamplingParams] = None) -> AsyncRequestStream:
        """stream() for asyncio: an async iterator of StreamOutput items, to be called and read
        in a running event loop, which it never blocks. The request is submitted at once;
        `await stream.started()` (or the first item) raises the ValueError of a refused request.
        `await stream.aclose()` (or leaving `async with stream:`) aborts an unfinished request."""
        return self._astream(prompt, params)

    def _astream(self, prompt: Any, params: Optional[SamplingParams] = None,
                 request_hooks: Optional[Callable[[Any], None]] = None) -> AsyncRequestStream:
        event_loop = asyncio.get_running_loop()  # RuntimeError outside a running event loop
        item, req, text = self._stream_request(prompt, params, request_hooks)
        items: "asyncio.Queue[Any]" = asyncio.Queue()
        sink = StreamSink(text, async_put(event_loop, items))
        submitted = self._engine_loop().submit([req], [sink])
        return AsyncRequestStream(self, self._loop, submitted, item.token_ids, items)

    def _stream_request(self, prompt: Any, params: Optional[SamplingParams], request_hooks) -> Any:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        item = self._to_prompt(prompt)
        return item, self._request_input(item, params, request_hooks), TextStream(self.tokenizer, params.stop)

    def abort(self, request_id: int) -> bool:
        """Aborts a request of this session (a stream item's request_id) and returns once its KV
        blocks are free: True if it was unfinished. Its stream ends with finish_reason "abort"."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise ValueError(f"request_id must be an int, got {request_id!r}")
        return self._loop.abort([request_id]).result()[0]

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        return self._loop.closed

    def close(self) -> None:
        """Stops the engine thread (requests still running end with finish_reason "abort");
        generating afterwards is a ValueError. Also done by `with Session(...) as s:`, when the
        session is garbage-collected, and at interpreter exit. stats() still works."""
        self._loop.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ drafter inspection
    def propose(self, token_ids: Sequence[int]):
        """Drafter debugging: prefill `token_ids`, add their features to the drafter's context,
        and run one draft step from the target's greedy next token (the anchor).

        Returns (draft_token_ids, draft_logits) as numpy arrays of shapes [n] and [n, vocab],
        n = num_speculative_tokens. Runs in KV blocks of its own: no other request or state
        changes. Needs a Session made with draft=...
        """
        if self.draft_dir is None:
            raise ValueError("propose() needs a Session with a draft model (draft=...)")
        ids = list(token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("token_ids must be a list of ints")
        with self._loop.core_lock:
            return self._core.propose(ids)

    def propose_details(self, token_ids: Sequence[int]) -> Dict[str, Any]:
        """propose() with the drafter's intermediate results: a dict with draft_ids [n] and
        draft_logits [n, vocab]; for a DFlash2 drafter also k (candidates per slot),
        candidate_ids [n, k], unary [n, k] (scaled and capped LM-head values), edges [n, k, k]
        (edges[s, p, c]: candidate p of slot s-1, or the anchor for s = 0, to candidate c of slot
        s) and realized [n, k] (the edge row the greedy walk read at each slot)."""
        import numpy as np

        if self.draft_dir is None:
            raise ValueError("propose_details() needs a Session with a draft model (draft=...)")
        ids = list(token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("token_ids must be a list of ints")
        with self._loop.core_lock:
            d = dict(self._core.propose_details(ids))
        d["draft_ids"] = np.asarray(d["draft_ids"], dtype=np.int32)
        if d["k"] > 0:
            k = d["k"]
            d["candidate_ids"] = np.asarray(d["candidate_ids"], dtype=np.int32).reshape(-1, k)
            d["edges"] = np.asarray(d["edges"]).reshape(-1, k, k)
        return d

    # ------------------------------------------------------------------ introspection
    def stats(self) -> Dict[str, Any]:
        """Memory and counters: weight/KV bytes, KV blocks (total and free), engine counters.

        cuda_graphs: decode steps replay captured CUDA graphs; async_decode: decode steps are
        pipelined (the option of that name); graph_steps / eager_steps: decode
        steps run as graph replays / eagerly (graphs off, or the CPU); eager_forwards: eager
        ragged forwards (prefills; AR decode rows recording taps). spec_time_s: per-phase times
        of speculative decode steps, measured only when they run eagerly (the phases of a graph
        are not timed separately); decode_time_s: wall time of all decode steps, of which the host
        spent host_stage_s staging inputs, host_launch_s queueing the steps (a graph launch, or
        every op when eager) and host_wait_s waiting for the device; pipelined_steps /
        dropped_rows (async_decode): steps launched ahead of their predecessor's tokens, and rows
        of such steps computed for requests that had ended. num_preemptions: running requests whose
        KV blocks were taken back when the cache ran out (each resumes by recomputing its prompt
        and generated tokens, with the same output); num_prefill_chunks: prefill chunks run.
        num_running_requests / num_waiting_requests: unfinished requests that have produced a
        token / not yet (queued or in their prefill). num_free_blocks counts evictable blocks too
        (cached, held by no request). Prefix caching: prefix_caching (on or off), num_cached_blocks
        (blocks holding a cached prefix, in use or not), num_evictable_blocks (those no request
        holds), num_evicted_blocks (evictions so far), prefix_cache_query_tokens /
        prefix_cache_hit_tokens (prefill tokens of admitted requests looked up in the cache /
        found there instead of computed).
        speculation: "fixed" / "adaptive" (None without a drafter); draft_lengths: the draft lengths
        with decode programs; spec_length_steps: {draft length: speculative decode steps run with
        it} (0: AR steps of adaptive speculation, not counted in num_spec_steps);
        spec_cost_table (adaptive): {"batch_sizes", "lengths", "seconds" [batch size][length]},
        the step costs the policy uses, measured at start-up in spec_cost_measure_s."""
        with self._loop.core_lock:  # the engine thread steps the session while holding it
            # every field under its key, from the one list in include/dflash/stats.h
            st = self._core.stats().as_dict()
            running, waiting = self._loop.request_counts()
        # The raw fields reported only in a derived form are replaced by it.
        emitted = st.pop("num_spec_emitted")
        spec_time = {"draft": st.pop("time_draft_s"), "verify": st.pop("time_verify_s"),
                     "accept": st.pop("time_accept_s"), "context_update": st.pop("time_context_s")}
        costs = {"batch_sizes": st.pop("spec_cost_batch_sizes"), "lengths": st.pop("spec_cost_lengths"),
                 "seconds": st.pop("spec_cost_seconds")}
        # the engine loop's counts, which split requests by whether they have produced a token yet
        st["num_running_requests"], st["num_waiting_requests"] = running, waiting
        st["draft_sampling"] = st["draft_sampling"] or None
        st["speculation"] = st["speculation"] or None
        st["spec_length_steps"] = {n: st["spec_length_steps"][n] for n in st["draft_lengths"]}
        st["acceptance_length"] = (emitted / st["num_spec_steps"]) if st["num_spec_steps"] else 0.0
        st["spec_time_s"] = spec_time
        st["spec_cost_table"] = costs if costs["batch_sizes"] else None
        return st
