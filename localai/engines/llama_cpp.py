"""The GGUF engine: llama.cpp through llama-cpp-python's low-level API, inside a worker process.

One llama.cpp context holds ``n_parallel`` sequences, each with its own KV stream (``kv_unified`` off, so idle
sessions do not slow active decoding). The serving loop (``engines/serving.py``) batches the sequences' tokens
into each ``llama_decode``; this module evaluates, samples with llama.cpp's sampler chains (grammars included),
and moves one sequence's KV state in and out with ``llama_state_seq_*``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import re
import struct
from typing import Any, ClassVar

import llama_cpp as L
import numpy as np

from localai.engines import llama_devices, llama_rpc, llama_state
from localai.engines.descriptions import speculative_support, state_kind
from localai.engines.engine import (
    BatchItem,
    DecodeFailed,
    LoadOptions,
    RerankUnsupported,
    prefill_chunk,
    stable_by_probes,
    top_logprobs,
)
from localai.engines.grammars import HERMES_TRIGGER, GrammarError, grammar_for
from localai.engines.llama_devices import LoadReport
from localai.engines.llama_embed import EmbeddingContext, RankContext, free_context
from localai.engines.llama_tokens import PrefixTokenizer, Vocabulary
from localai.engines.llama_vision import Vision
from localai.engines.placement import ModelSizes, Placement, cpu_only, place
from localai.promptcache.store import StateBytes
from localai.protocol import DEFAULT_SAMPLING, Constraint, ModelInfo, Sampling

log = logging.getLogger("localai.worker")

STATE_BUFFER_MAX = 512 << 20  # a larger state (a long context on a large model) gets a buffer of its own each save
KV_TYPES = {"f16": L.GGML_TYPE_F16, "q8_0": L.GGML_TYPE_Q8_0, "q4_0": L.GGML_TYPE_Q4_0}

__all__ = ["DEFAULT_SAMPLING", "LlamaCppEngine", "LoadOptions"]

_LOG_CALLBACK: Any = None
_LOAD_REPORT: LoadReport | None = None  # fed by llama.cpp's log while a model loads


def quiet_llama_logs(debug: bool) -> None:
    """Route llama.cpp's logging: silence it unless debugging (it writes to stderr otherwise); while a model loads,
    what it says of offloaded layers and buffers goes to the ``LoadReport``."""
    global _LOG_CALLBACK

    def callback(level: int, text: bytes, _user: Any) -> None:
        if _LOAD_REPORT is not None and text:
            _LOAD_REPORT.feed(text.decode(errors="replace"))
        if debug and text:
            log.debug("llama.cpp: %s", text.decode(errors="replace").rstrip())

    _LOG_CALLBACK = L.llama_log_callback(callback)
    L.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def repacks_weights(setting: str, system_info: str | None = None) -> bool:
    """Whether llama.cpp may repack weights into its CPU layouts (``use_extra_bufts``). ``auto`` does, unless this
    build of llama.cpp has AMX kernels: on some Sapphire Rapids machines (VMs among them) the first batched matmul
    in an AMX buffer segfaults (llama.cpp #20824), which would take every worker down on its first prompt."""
    if setting != "auto":
        return setting == "on"
    info = system_info if system_info is not None else L.llama_print_system_info().decode(errors="replace")
    return "AMX_INT8 = 1" not in info


# Greedy decoding without a grammar or penalties: the argmax of the row's logits. llama.cpp's sampler chain would
# first copy the whole vocabulary into a candidate array (49k entries on smollm2: 0.1-0.4 ms a token, the largest
# per-token cost around llama_decode with four streams on 2 cores).
GREEDY = object()


class TensorBufferOverride(ctypes.Structure):
    """llama.h's ``llama_model_tensor_buft_override`` (llama-cpp-python leaves it unbound): tensors whose name
    matches ``pattern`` (a regex) are allocated in ``buft``."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def load_failure(path: str, error: str | None) -> str:
    """What to tell about a model llama.cpp would not load, from what it said."""
    unknown = re.search(r"unknown model architecture: '([^']*)'", error or "")
    if unknown:
        return (f"the llama.cpp in llama-cpp-python {L.__version__} does not know the architecture "
                f"'{unknown[1]}' of {path}: a newer llama-cpp-python may (pip install -U llama-cpp-python)")
    return f"llama.cpp (llama-cpp-python {L.__version__}) could not load {path}" + (f": {error}" if error else "")


# Encoders whose attention is not causal (rerankers and embedders of the BERT family), where a file does not say so
NON_CAUSAL = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "neo-bert",
                        "modern-bert", "eurobert"})


class LlamaCppEngine:
    """A loaded GGUF model with ``n_parallel`` sequences."""

    backend: ClassVar[str] = "llama.cpp"
    can_trim = True  # llama.cpp refuses a cut it cannot make (seq_keep says so), and the loop recomputes

    def __init__(self, options: LoadOptions, *, debug: bool = False) -> None:
        # Placement first: asking llama.cpp for its devices starts the GPU backends, whose start-up lines (the
        # device found, its memory) then reach the worker's log as llama.cpp prints them.
        llama_rpc.add_servers(options.rpc_servers)  # their devices join the ones placement spreads layers over
        self.placement = self._place(options)
        quiet_llama_logs(debug)
        L.llama_backend_init()
        self.options = options
        model_params = L.llama_model_default_params()
        model_params.use_mmap = options.use_mmap
        model_params.use_extra_bufts = repacks_weights(options.cpu_repack)
        if not model_params.use_extra_bufts and options.cpu_repack == "auto":
            log.info("llama.cpp was built with AMX kernels, which crash on some CPUs (llama.cpp #20824): weights "
                     "are not repacked (LOCALAI_CPU_REPACK=on to repack anyway)")
        global _LOAD_REPORT
        model_params.n_gpu_layers = self.placement.layers
        self._overrides = self._expert_overrides(self.placement.cpu_moe if self.placement.layers else 0)
        if self._overrides is not None:
            model_params.tensor_buft_overrides = ctypes.addressof(self._overrides)
        _LOAD_REPORT = report = LoadReport()
        self.vision: Vision | None = None
        n_batch = options.n_batch
        try:
            self.model = L.llama_model_load_from_file(options.model_path.encode(), model_params)
            if not self.model:
                raise RuntimeError(load_failure(options.model_path, report.error))
            if options.projector_path:
                self.vision = Vision(self.model, options.projector_path, options.n_threads,
                                     use_gpu=self.placement.layers > 0, debug=debug)
                non_causal, image_tokens = self.vision.probe()
                if non_causal:  # an image evaluated in one pass (Gemma 3) fits a batch beside every sequence's token
                    n_batch = max(n_batch, image_tokens + options.n_parallel)
            self._create_context(options, n_batch)
        except BaseException:
            if self.vision is not None:
                self.vision.close()
            raise
        finally:
            _LOAD_REPORT = None
        self.load_report = report  # what llama.cpp said of its buffers (tests compare the estimates with it)
        self._reported(report)
        self.prefill_chunk = prefill_chunk(options.n_batch, on_gpu=bool(self.placement.layers),
                                           weights_bytes=int(L.llama_model_size(self.model)))
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self._piece = ctypes.create_string_buffer(256)
        self._state_buffer = bytearray()  # seq_state's, reused
        self.bos_id = int(L.llama_vocab_bos(self.vocab))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.embedder: EmbeddingContext | None = None  # created on the first embedding request
        self.ranker: RankContext | None = None  # a reranker's, created on the first rerank request
        self.n_swa = int(L.llama_model_n_swa(self.model))  # sliding window (Gemma 3): its KV holds only the window
        self.recurrent = bool(L.llama_model_is_recurrent(self.model) or L.llama_model_is_hybrid(self.model))
        # A sliding window or recurrent layers (Qwen3.5, Nemotron-H, Mamba) cannot be cut back to any earlier
        # token: such a sequence returns only to checkpoints, the part llama.cpp writes with PARTIAL_ONLY
        self.checkpoints = bool(self.n_swa) or self.recurrent
        # Latent attention (DeepSeek's MLA: GLM-4.7-Flash, Kimi) caches K alone: its state has no V section
        self.architecture = self._meta("general.architecture") or "unknown"
        self.latent_attention = all(int(self._meta(f"{self.architecture}.attention.{key}") or 0) > 0
                                    for key in ("key_length_mla", "value_length_mla"))
        # Rejected drafts are dropped from the end of the KV; a window's cells past it, or a recurrent state's
        # earlier values, may be gone already: no speculative decoding on such models
        self.can_draft = not self.checkpoints
        # A batch's rows are not bit-identical to the same tokens one at a time (up to ~1 logit on SmolLM2 on a
        # CPU, with flash attention or without, once the context is a few hundred tokens): greedy text could differ
        # at a near tie, so drafts are used only when asked for (PARAMETER speculative on)
        self.drafts_exact = False
        self.prompt_tokens = PrefixTokenizer(self._vocabulary, self._tokenize_whole, self.tokenize_special)
        self._rows: dict[int, int] = {}  # a batch's logits rows where image positions moved them (llama_vision)
        self.adapters = self._apply_adapters(options.adapters)
        # images whose embeddings take fewer positions than tokens (the Qwen-VL family): positions are mapped
        self.mrope = bool(self.vision and self.vision.mrope)
        if self.vision is not None:
            self.vision.ctx = self.ctx
            self.can_draft = False  # drafts copied from the context could propose an image's pseudo-tokens

    def _apply_adapters(self, adapters: list[dict[str, Any]]) -> list[Any]:
        """Load the LoRA adapters and apply them to the chat context with their scales (as llama-server's --lora
        and --lora-scaled; the embedding and rerank contexts stay without). llama.cpp frees them with the model."""
        loaded = []
        for adapter in adapters:
            handle = L.llama_adapter_lora_init(self.model, str(adapter["path"]).encode())
            if not handle:
                raise RuntimeError(f"llama.cpp could not load the LoRA adapter {adapter['path']} (not a LoRA GGUF for "
                                   "this model's tensors?)")
            loaded.append(handle)
        if loaded:
            handles = (L.llama_adapter_lora_p_ctypes * len(loaded))(*loaded)
            scales = (ctypes.c_float * len(loaded))(*(float(adapter["scale"]) for adapter in adapters))
            if L.llama_set_adapters_lora(self.ctx, handles, len(loaded), scales) != 0:
                raise RuntimeError("llama.cpp could not apply the LoRA adapters to the context")
        return loaded

    def _place(self, options: LoadOptions) -> Placement:
        """The layers to offload (``engines/placement.py``): by the GPUs' free memory, or ``num_gpu``."""
        gpus = [device for device in llama_devices.devices() if device.offloads]
        registered = llama_devices.backends()
        backends = [name for name in registered if name not in ("CPU", "BLAS", "RPC")]
        if not gpus:
            if backends:  # a GPU build whose device is gone (unplugged, hidden, driver missing)
                hint = " (a CPU Vulkan driver such as llvmpipe needs GGML_VK_VISIBLE_DEVICES=0)" \
                    if "Vulkan" in backends else ""
                log.warning("llama.cpp's %s backend found no device%s: running on the CPU", "/".join(backends), hint)
            layers = len(options.layer_bytes) + 1 if options.layer_bytes is not None else 0
            return cpu_only(options.weights_bytes + options.kv_bytes, layers, "no GPU: llama.cpp found no device to "
                            f"offload to (backends: {', '.join(registered)})")
        if options.layer_bytes is None:  # sizes not read: as llama.cpp's own default, every layer (or num_gpu)
            layers = options.num_gpu if options.num_gpu >= 0 else 999
            return Placement(layers, 0, 0, options.weights_bytes + options.kv_bytes, [], "the model's sizes are "
                             "not known: " + (f"num_gpu {layers}" if layers < 999 else "every layer"))
        sizes = ModelSizes(options.layer_bytes, options.output_bytes, options.kv_bytes, options.weights_bytes,
                           options.expert_bytes)
        chosen = place(sizes, gpus, num_gpu=options.num_gpu, overhead=options.gpu_overhead,
                       host_free=options.host_free, num_cpu_moe=options.num_cpu_moe)
        log.info("placement: %d/%d layers on %s: %s", chosen.layers, chosen.layers_total,
                 ", ".join(f"{d.name} ({d.description})" for d in gpus), chosen.reason)
        return chosen

    @staticmethod
    def _expert_overrides(layers: int) -> Any:
        """llama.cpp's tensor buffer-type overrides that keep the expert tensors of the first ``layers`` layers in
        host memory (as ``--n-cpu-moe`` does): a NULL-terminated array, kept alive while the model loads."""
        if layers <= 0:
            return None
        cpu = llama_devices.cpu_buffer_type()
        if not cpu:
            log.warning("llama.cpp has no CPU buffer type to keep experts in: offloading them with their layers")
            return None
        overrides = (TensorBufferOverride * (layers + 1))()  # zeroed: the last one ends the list
        for index in range(layers):
            overrides[index].pattern = rf"blk\.{index}\.ffn_(up|down|gate|gate_up)_(ch|)exps".encode()
            overrides[index].buft = cpu
        return overrides

    def _reported(self, report: LoadReport) -> None:
        """The placement as llama.cpp carried it out: its own layer count and device buffer sizes where it said
        them (model weights and KV cache), the estimate where it did not."""
        placement = self.placement
        if report.offloaded is not None and report.layers_total is not None:
            placement.layers, placement.layers_total = report.offloaded, report.layers_total
        elif placement.layers >= 999:
            placement.layers = 0  # a CPU build: nothing was offloaded
        measured = report.device_bytes()
        if report.buffers:
            placement.device_bytes = measured
            placement.total_bytes = max(placement.total_bytes, sum(
                size for key, size in report.buffers.items() if key.split()[1] in ("model", "KV", "RS")))
        if not placement.layers:
            placement.devices, placement.device_bytes = [], 0
        placement.layer_devices = report.layer_spans()

    def _create_context(self, options: LoadOptions, n_batch: int) -> None:
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(self.model))
        self.n_ctx = min(options.num_ctx, self.n_ctx_train) if self.n_ctx_train > 0 else options.num_ctx
        self.n_seq = options.n_parallel
        self.n_batch = n_batch
        ctx_params = L.llama_context_default_params()
        ctx_params.n_ctx = self.n_ctx * options.n_parallel
        ctx_params.n_batch = n_batch
        ctx_params.n_ubatch = n_batch
        ctx_params.n_seq_max = options.n_parallel
        ctx_params.kv_unified = False  # one KV stream per sequence: idle sessions do not slow active decoding
        ctx_params.n_threads = options.n_threads
        ctx_params.n_threads_batch = options.n_threads
        # A quantized V cache needs flash attention in llama.cpp (without it the context is refused). Layers on RPC
        # servers get it too: without it V is stored transposed, and llama.cpp reads a sequence's state (every
        # prompt-cache save) one row of V at a time, each a network round trip: 5,760 of them a save on smollm2,
        # 336 ms per request over two loopback servers instead of 25 ms (as llama-server's -fa auto on GPUs).
        self.flash_attention = options.flash_attention or options.kv_type != "f16" or self.placement.uses_rpc
        ctx_params.flash_attn_type = (
            L.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attention else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        # Sliding-window layers keep only their window (llama-cpp-python's default keeps every cell): a Gemma 3
        # context of 4 x 32k took 2.7 GB instead of 0.8 GB and 3.1 s instead of 0.6 s to create.
        ctx_params.swa_full = False
        ctx_params.type_k = KV_TYPES[options.kv_type]
        ctx_params.type_v = KV_TYPES[options.kv_type]
        ctx_params.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self.memory = L.llama_get_memory(self.ctx)

    def fingerprint_parts(self) -> dict[str, Any]:
        template = self.options.template or (L.llama_model_chat_template(self.model, None) or b"").decode()
        return {
            "model_sha256": self.options.model_sha256 or self.options.model_path,
            "engine": f"llama-cpp-python {L.__version__}", "n_ctx": self.n_ctx,
            "n_seq_max": self.options.n_parallel, "kv_unified": False, "type_k": self.options.kv_type,
            "type_v": self.options.kv_type, "flash_attention": self.flash_attention,
            "chat_template": hashlib.sha256(template.encode()).hexdigest(),
            **({"swa_full": False} if self.n_swa else {}),  # the window's cells only: another state layout
            # cut into blocks plus a checkpoint tail (before, a recurrent model's states were kept whole)
            **({"state_layout": 2} if self.checkpoints else {}),
        }

    # -- model facts -----------------------------------------------------------------------------

    def info(self) -> ModelInfo:
        template = L.llama_model_chat_template(self.model, None)
        return ModelInfo(
            backend=self.backend,
            engine_version=f"llama-cpp-python {L.__version__}",
            n_ctx=self.n_ctx,
            n_ctx_train=self.n_ctx_train,
            n_parallel=self.options.n_parallel,
            n_vocab=self.n_vocab,
            bos_token=self._token_text(self.bos_id),
            eos_token=self._token_text(int(L.llama_vocab_eos(self.vocab))),
            chat_template=template.decode() if template else None,
            architecture=self.architecture,
            flash_attention=self.flash_attention,
            kv_type=self.options.kv_type,
            placement=self.placement.report(),
            state=state_kind(self.recurrent, self.n_swa),
            speculative=speculative_support(self.can_draft, self.recurrent, self.n_swa),
        )

    def _meta(self, key: str) -> str | None:
        buffer = ctypes.create_string_buffer(256)
        length = L.llama_model_meta_val_str(self.model, key.encode(), buffer, len(buffer))
        return buffer.value.decode(errors="replace") if length >= 0 else None

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._piece_bytes(token, special=True).decode(errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return self._piece_bytes(token)

    def _piece_bytes(self, token: int, *, special: bool = False) -> bytes:
        length = L.llama_token_to_piece(self.vocab, token, self._piece, len(self._piece), 0, special)
        if length < 0:
            bigger = ctypes.create_string_buffer(-length)
            length = L.llama_token_to_piece(self.vocab, token, bigger, len(bigger), 0, special)
            return bigger.raw[:length]
        return self._piece.raw[:length]

    def is_end(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    def tokenize(self, text: str) -> list[int]:
        """Tokens of a rendered prompt: special tokens parsed, BOS added once when the model wants one. An empty
        text is BOS alone, so there is always something to evaluate. A prompt that extends a recent one reuses its
        tokens up to their last turn marker (``llama_tokens``); one with image marks goes through the projector."""
        if self.vision is not None and self.vision.marked(text):
            return self.vision.tokenize(text, self.bos_id)
        return self.prompt_tokens.tokenize(text)

    def stable_prefix(self, text: str, tokens: list[int]) -> int:
        return stable_by_probes(lambda probed: self.prompt_tokens.tokenize(probed, remember=False), text, tokens)

    def remember_media(self, media: dict[str, str], op_id: str) -> None:
        """Keep the images op ``op_id`` sent for its prompt's marks (a model with a vision projector) until
        ``release_media`` (the serving loop calls both: as it takes the op and at its final frame)."""
        if self.vision is None:
            raise ValueError("this model has no vision projector: images reach it as text stand-ins")
        self.vision.hold(op_id, list(media))  # first: remembering them may forget others past the bound
        try:
            self.vision.remember(media)
        except BaseException:  # a bad image: the op fails, and holds nothing
            self.vision.release(op_id)
            raise

    def release_media(self, op_id: str) -> None:
        if self.vision is not None:
            self.vision.release(op_id)

    def _tokenize_whole(self, text: str) -> list[int]:
        tokens = self._tokens(text, self.add_bos)
        if self.add_bos and len(tokens) > 1 and tokens[0] == tokens[1] == self.bos_id:
            tokens = tokens[1:]  # the template already wrote BOS
        if not tokens and self.bos_id >= 0:
            tokens = [self.bos_id]
        return tokens

    def tokenize_special(self, text: str) -> list[int]:
        """Tokens of ``text`` alone (special tokens parsed, no BOS)."""
        return self._tokens(text, False)

    def _tokens(self, text: str, add_bos: bool, special: bool = True) -> list[int]:
        data = text.encode()
        capacity = len(data) + 16
        buffer = (L.llama_token * capacity)()
        count = L.llama_tokenize(self.vocab, data, len(data), buffer, capacity, add_bos, special)
        if count < 0:
            capacity = -count
            buffer = (L.llama_token * capacity)()
            count = L.llama_tokenize(self.vocab, data, len(data), buffer, capacity, add_bos, special)
        return list(buffer[:max(count, 0)])

    def _vocabulary(self) -> Vocabulary:
        """The special tokens as llama.cpp's tokenizer partitions text by them, for ``PrefixTokenizer``."""
        strips = L.LLAMA_TOKEN_ATTR_LSTRIP | L.LLAMA_TOKEN_ATTR_RSTRIP
        cuttable = (int(L.llama_vocab_type(self.vocab)) in (L.LLAMA_VOCAB_TYPE_SPM, L.LLAMA_VOCAB_TYPE_BPE)
                    and not L.llama_vocab_get_add_eos(self.vocab) and not L.llama_vocab_get_add_sep(self.vocab))
        control: dict[int, str] = {}
        special: dict[int, set[str]] = {}
        for token in range(self.n_vocab):
            attr = int(L.llama_vocab_get_attr(self.vocab, token))
            if not attr & (L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED | L.LLAMA_TOKEN_ATTR_UNKNOWN):
                continue
            try:
                text = (L.llama_vocab_get_text(self.vocab, token) or b"").decode()
            except UnicodeDecodeError:
                cuttable = False  # offsets in bytes and in characters could differ
                break
            cuttable = cuttable and not attr & strips
            if text:
                special.setdefault(len(text), set()).add(text)
                if attr & L.LLAMA_TOKEN_ATTR_CONTROL:
                    control[token] = text
        return Vocabulary(cuttable, control, {length: frozenset(texts) for length, texts in special.items()})

    # -- sampling --------------------------------------------------------------------------------

    def _grammar_sampler(self, constraint: Constraint | None) -> Any:
        if constraint and constraint.get("lazy") and len(self.tokenize_special(HERMES_TRIGGER)) != 1:
            return None  # see below: a lazy grammar needs its trigger to be one token
        grammar = grammar_for(constraint)
        if grammar is None:
            return None
        if grammar.trigger:
            # Only a trigger that is one token is safe: triggered by text, llama.cpp feeds the grammar the whole
            # last piece, and a piece running past the trigger ("<tool_call" + "></") makes it throw a C++
            # exception that aborts the worker. Models without such a token get their calls parsed, unconstrained.
            trigger = self.tokenize_special(grammar.trigger)
            tokens = (L.llama_token * 1)(trigger[0])
            sampler = L.llama_sampler_init_grammar_lazy_patterns(
                self.vocab, grammar.text.encode(), b"root", None, 0, tokens, 1)
        else:
            sampler = L.llama_sampler_init_grammar(self.vocab, grammar.text.encode(), b"root")
        if not sampler:
            raise GrammarError("the grammar built for this request could not be parsed by llama.cpp")
        return sampler

    def new_sampler(self, sampling: Sampling, constraint: Constraint | None) -> Any:
        options: dict[str, Any] = {**DEFAULT_SAMPLING, **{k: v for k, v in sampling.items() if v is not None}}
        grammar_sampler = self._grammar_sampler(constraint)
        penalties = options["repeat_penalty"] != 1.0 or options["presence_penalty"] or options["frequency_penalty"]
        if float(options["temperature"]) <= 0 and grammar_sampler is None and not penalties:
            return GREEDY
        params = L.llama_sampler_chain_default_params()
        chain = L.llama_sampler_chain_init(params)
        if grammar_sampler:
            L.llama_sampler_chain_add(chain, grammar_sampler)
        if penalties:
            last_n = int(options["repeat_last_n"])
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(
                self.n_vocab, self.n_ctx if last_n < 0 else min(last_n, self.n_ctx),
                float(options["repeat_penalty"]),
                float(options["frequency_penalty"]), float(options["presence_penalty"])))
        temperature = float(options["temperature"])
        if temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        if int(options["top_k"]) > 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(int(options["top_k"])))
        if float(options["typical_p"]) < 1.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_typical(float(options["typical_p"]), 1))
        if float(options["top_p"]) < 1.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(float(options["top_p"]), 1))
        if float(options["min_p"]) > 0.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(float(options["min_p"]), 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
        seed = options.get("seed")
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(
            int(seed) & 0xFFFFFFFF if seed is not None else L.LLAMA_DEFAULT_SEED))
        return chain

    def free_sampler(self, sampler: Any) -> None:
        if sampler is not GREEDY:
            L.llama_sampler_free(sampler)

    def sample(self, sampler: Any, row: int) -> int:
        row = self._rows.get(row, row)
        if sampler is GREEDY:  # the row's argmax, read in place (the first of equal maxima, as llama.cpp's greedy)
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
            return int(logits.argmax())
        return int(L.llama_sampler_sample(sampler, self.ctx, row))

    def logprobs(self, row: int, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        row = self._rows.get(row, row)
        return top_logprobs(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,)),
                            token, top)

    # -- evaluation ------------------------------------------------------------------------------

    def decode(self, batch: list[BatchItem]) -> None:
        self._rows = {}
        if self.vision is not None:
            self.vision.decoded(batch)
        if self.mrope:
            assert self.vision is not None
            batch = self.vision.positioned(batch)
        if self.vision is not None and self.vision.holds_images(batch):
            self._rows = self.vision.decode(batch, self._decode_tokens)
            return
        self._decode_tokens(batch)

    def _decode_tokens(self, batch: list[BatchItem]) -> None:
        native = self.batch
        for index, item in enumerate(batch):
            native.token[index] = item.token
            native.pos[index] = item.pos
            native.n_seq_id[index] = 1
            native.seq_id[index][0] = item.seq
            native.logits[index] = item.logits
        native.n_tokens = len(batch)
        status = L.llama_decode(self.ctx, native)
        if status == 1:
            raise DecodeFailed("the KV cache is full: too many long sequences at once; lower LOCALAI_NUM_PARALLEL "
                               "or num_ctx", no_room=True)
        if status != 0:
            raise DecodeFailed(f"llama_decode failed with status {status}")

    # -- sequences -------------------------------------------------------------------------------

    @property
    def images_encoded(self) -> int:
        return self.vision.encoded if self.vision is not None else 0

    def span_end(self, tokens: list[int], index: int) -> tuple[int, int] | None:
        return self.vision.span_end(tokens, index) if self.vision is not None else None

    def _position(self, seq: int, index: int) -> int:
        """Where token ``index`` of a sequence sits (its index, but for the Qwen-VL family's images)."""
        return self.vision.spans.position(seq, index) if self.mrope and self.vision is not None else index

    def seq_keep(self, seq: int, n_tokens: int) -> bool:
        if self.mrope and self.vision is not None:
            if self.vision.spans.inside(seq, n_tokens):
                return False  # an image's embeddings share their time position: cut before it or after it
            if not L.llama_memory_seq_rm(self.memory, seq, self._position(seq, n_tokens), -1):
                return False
            self.vision.spans.cut(seq, n_tokens)
            self.vision.seq_cut(seq, n_tokens)
            return True
        if self.n_swa and n_tokens > 0:
            # Sliding-window layers may have dropped every position older than the window: cut back further
            # than one token, the next token would attend to missing cells (llama.cpp would not say so).
            length = int(L.llama_memory_seq_pos_max(self.memory, seq)) + 1
            if length > self.n_swa and n_tokens < length - 1:
                return False
        if not L.llama_memory_seq_rm(self.memory, seq, n_tokens, -1):
            return False
        if self.vision is not None:
            self.vision.seq_cut(seq, n_tokens)
        return True

    def seq_clear(self, seq: int) -> None:
        L.llama_memory_seq_rm(self.memory, seq, -1, -1)
        if self.vision is not None:
            self.vision.spans.cut(seq, 0)
            self.vision.seq_cut(seq, 0)

    def seq_state(self, seq: int) -> StateBytes:
        """The sequence's state, valid until the next call: written into a buffer kept between saves (up to
        ``STATE_BUFFER_MAX``), since a fresh one costs llama.cpp's copy a page fault per 4 KiB (3.5x the copy itself
        at 4k tokens on smollm2). The store copies out what it keeps before the next save."""
        size = L.llama_state_seq_get_size(self.ctx, seq)
        buffer = self._state_buffer
        if len(buffer) < size:
            buffer = bytearray(size + size // 8)  # room to grow a turn or two without another allocation
            self._state_buffer = buffer if len(buffer) <= STATE_BUFFER_MAX else bytearray()
        written = L.llama_state_seq_get_data(self.ctx, (ctypes.c_uint8 * size).from_buffer(buffer), size, seq)
        return memoryview(buffer)[:written]

    def seq_restore(self, seq: int, state: StateBytes, tokens: list[int] | None = None) -> bool:
        if isinstance(state, bytearray):  # assembled from blocks: loaded in place
            buffer = (ctypes.c_uint8 * len(state)).from_buffer(state)
        else:
            buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if not L.llama_state_seq_set_data(self.ctx, buffer, len(state), seq):
            return False
        if self.mrope and self.vision is not None and not self.vision.track(seq, list(tokens or [])):
            self.seq_clear(seq)  # an image it holds is not known here: its positions cannot be mapped
            return False
        if self.vision is not None:
            self.vision.seq_holds(seq, list(tokens or []))
        return True

    def seq_checkpoint(self, seq: int) -> bytes:
        """The part of the sequence's state that cannot be cut by token (window, recurrent layers), as it is now: with
        the attention KV up to the same token, all a sequence needs to return here (empty when llama.cpp failed)."""
        size = L.llama_state_seq_get_size_ext(self.ctx, seq, L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        buffer = (ctypes.c_uint8 * size)()
        written = L.llama_state_seq_get_data_ext(self.ctx, buffer, size, seq, L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        return bytes(buffer)[:written]

    def seq_rollback(self, seq: int, checkpoint: bytes, n_tokens: int) -> bool:
        """Return a sequence to a checkpoint taken when it held ``n_tokens`` tokens: the partial state put back, the
        attention KV past it dropped. False (the sequence then cleared) when llama.cpp refuses either."""
        buffer = (ctypes.c_uint8 * len(checkpoint)).from_buffer_copy(checkpoint)
        if not L.llama_state_seq_set_data_ext(self.ctx, buffer, len(checkpoint), seq,
                                              L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY):
            self.seq_clear(seq)
            return False
        if self.mrope and self.vision is not None and self.vision.spans.inside(seq, n_tokens):
            self.seq_clear(seq)
            return False
        last = self._position(seq, n_tokens - 1) if n_tokens else -1
        if not L.llama_memory_seq_rm(self.memory, seq, self._position(seq, n_tokens), -1) \
                or int(L.llama_memory_seq_pos_max(self.memory, seq)) != last:
            self.seq_clear(seq)
            return False
        if self.vision is not None:
            self.vision.spans.cut(seq, n_tokens)
            self.vision.seq_cut(seq, n_tokens)
        return True

    def _tail_bytes(self, state: StateBytes) -> int:
        """How many bytes at the end of ``state`` are the part that cannot be cut (0 for plain attention): what
        llama.cpp writes with PARTIAL_ONLY for the same sequence now, less its 8-byte header. ``state`` is the one
        ``seq_state`` just wrote (the store cuts it before the sequence moves on)."""
        if not self.checkpoints:
            return 0
        if len(state) < 8:
            raise ValueError("state too short")
        (seq,) = struct.unpack_from("<i", state, 4)
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"a state of sequence {seq}, which this engine does not have")
        return int(L.llama_state_seq_get_size_ext(self.ctx, seq, L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)) - 8

    def state_split(self, state: StateBytes, n_tokens: int,
                    ranges: list[tuple[int, int]]) -> tuple[Any, list[bytes], bytes] | None:
        try:
            layout, pieces, rest = llama_state.split(state, n_tokens, ranges, self._tail_bytes(state),
                                                     has_v=not self.latent_attention)
        except llama_state.StateFormatError as exc:
            raise ValueError(str(exc)) from exc
        return llama_state.layout_to_json(layout), pieces, rest

    def state_join(self, layout: Any, pieces: list[bytes], lengths: list[int], rest: bytes) -> StateBytes:
        try:
            return llama_state.join(llama_state.layout_from_json(layout), pieces, lengths, rest)
        except (llama_state.StateFormatError, KeyError, TypeError) as exc:
            raise ValueError(str(exc)) from exc

    # -- embeddings ------------------------------------------------------------------------------

    def embed(self, inputs: list[list[int]], *, truncate: bool) -> tuple[list[list[float]], int]:
        if self.embedder is None:
            self.embedder = EmbeddingContext(self.model, self.vocab, n_ctx=self.n_ctx,
                                             n_threads=self.options.n_threads)
        return self.embedder.embed(inputs, truncate=truncate)

    @property
    def reranker(self) -> bool:
        """A reranker's weights: rank pooling through a classifier head (bge-reranker, Qwen3-Reranker, jina)."""
        return self._meta(f"{self.architecture}.pooling_type") == str(int(L.LLAMA_POOLING_TYPE_RANK))

    def rerank(self, query: str, documents: list[str], *, truncate: bool) -> tuple[list[float], int]:
        if not self.reranker:
            raise RerankUnsupported("this model is not a reranker (its GGUF has no rank pooling)")
        if self.ranker is None:
            causal = self._meta(f"{self.architecture}.attention.causal") != "false" \
                and self.architecture not in NON_CAUSAL
            self.ranker = RankContext(self.model, self.vocab, self._tokens, n_ctx=self.n_ctx,
                                      n_threads=self.options.n_threads, causal=causal)
        pairs = [self.ranker.pair(query, document, truncate=truncate, index=index)
                 for index, document in enumerate(documents)]
        return self.ranker.score(pairs), sum(len(pair) for pair in pairs)

    def close(self) -> None:
        """Free the context, batch and weights (and the embedding and vision contexts). A worker's process frees
        them as it exits; benches and tests that build many engines in one process call this. Idempotent."""
        if self.vision is not None:
            self.vision.close()
            self.vision = None
        if self.embedder is not None:
            self.embedder.close()
            self.embedder = None
        if self.ranker is not None:
            self.ranker.close()
            self.ranker = None
        free_context(self)
        if self.model:
            L.llama_model_free(self.model)
            self.model = None
