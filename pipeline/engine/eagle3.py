"""EAGLE-3 draft heads (Li et al. 2025): the module, the proposer, and the three checkpoint layouts.

The head sees what the target saw. For each token position t the target has processed, it takes the
target's hidden states after a low, a middle and a high layer (EAGLE-3's "aux" layers: outputs of
layers 1, L/2-1 and L-4 by default, as in ModelOpt and the published heads), fuses them with `fc`
(3H -> H), and runs one decoder layer over [norm(embed(x_{t+1})); norm(fused_t)] (2H into qkv),
with its own KV cache. A final norm and an lm_head over a reduced draft vocabulary predict x_{t+2};
`d2t` maps a draft id back to a target id (target = draft + d2t[draft]). Chain drafting then feeds
the head's own pre-norm output as the next position's hidden state.

Layouts (all read into one engine layout):
- ModelOpt `export_speculative_decoding` (what `pipeline draft train` writes): `layers.0.*`, `fc`,
  `norm`, `lm_head`, `d2t`; config.json carries `eagle_config.eagle_aux_hidden_state_layer_ids`.
- The published yuhuili/EAGLE3-* heads: `midlayer.*` instead of `layers.0.*`, plus `t2d`.
- vLLM speculators: `layers.0.*` with a `speculators_model_type: eagle3` config whose decoder sizes
  sit in `transformer_layer_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from pipeline.engine import cpu_kernels
from pipeline.engine.config import ModelConfig
from pipeline.engine.cuda_graphs import GraphedHead
from pipeline.engine.kernels import AUTO, KernelSet
from pipeline.engine.kv_cache import ForwardBatch, KVCache
from pipeline.engine.linear import Linear, pack_linears
from pipeline.engine.model import MLP, Attention, RMSNorm, Transformer, stack_row
from pipeline.engine.proposers import GuidedDrafts, draft_plan, drafts_of, padded_ids
from pipeline.engine.request import Request
from pipeline.engine.sampling import probs_from_logits
from pipeline.engine.speculative import Proposal
from pipeline.errors import DraftMismatchError, ModelFormatError
from pipeline.models.families import family_for

def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Target layers whose *outputs* the head fuses: low, middle, high. The same rule as ModelOpt's
    default_eagle_aux_layer_ids and the EAGLE-3 reference (which captures the inputs of layers 2,
    L/2 and L-3, i.e. these outputs)."""
    return tuple(sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)}))


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's decoder layer: sizes, norm eps, its own rope
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose outputs are fused
    # ModelOpt trains the head as a stock LlamaDecoderLayer whose attention pre-hook concatenates, so
    # the fused hidden state goes through input_layernorm *and then* hidden_norm; the reference code
    # applies hidden_norm alone. Each layout runs the way its weights were trained.
    hidden_norm_after_input_norm: bool = False
    norm_before_residual: bool = False  # speculators' option: the residual is the normed hidden state
    layout: str = "modelopt"

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


HEAD_FLAGS = {"norm_twice": 1, "normed_residual": 2}  # head_layer's flags (HEAD_* in cpu_kernels.c)


@dataclass(frozen=True)
class LayerRow:
    """What cpu_kernels.head_layer needs of the head's weights: its layer's entries in the layer stack's table
    layout, and the tensors behind the addresses, held so they stay valid."""

    row: torch.Tensor  # int64 [23]
    group_size: int  # the int4 projections' (0 when there are none)
    flags: int
    held: list[torch.Tensor]


class Eagle3Head(nn.Module):
    fused = True  # the decoder layer in one C call where the kernels run all of it (tests compare the modules)
    kernels: KernelSet = AUTO  # the engine's (model.choose_kernels)

    def __init__(self, cfg: Eagle3Config, max_seq_len: int):
        super().__init__()
        self.cfg = cfg
        H, lc = cfg.hidden_size, cfg.layer
        self.fc = Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, H, bias=False)
        self.embed_norm = RMSNorm(H, lc.rms_norm_eps)  # input_layernorm in the checkpoints
        self.hidden_norm = RMSNorm(H, lc.rms_norm_eps)
        self.attn = Attention(lc, layer=0)
        self.attn.qkv = Linear(2 * H, (lc.num_heads + 2 * lc.num_kv_heads) * lc.head_dim, bias=lc.qkv_bias)
        self.post_norm = RMSNorm(H, lc.rms_norm_eps)
        self.mlp = MLP(lc)
        self.norm = RMSNorm(H, lc.rms_norm_eps)
        self.lm_head = Linear(H, cfg.draft_vocab_size, bias=False)
        # draft id -> target id (arange + d2t): one gather maps the argmax back.
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size), persistent=False)
        cos, sin = Transformer.rope_tables(lc, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._layer_row: LayerRow | bool | None = None  # see layer_row

    def layer_row(self) -> LayerRow | None:
        """When the layer's four projections run on the C kernels (as Transformer.layer_stack asks of each of the
        target's layers) and its norms are in the projections' dtype, on a CPU: what cpu_kernels.head_layer reads;
        else None. Worked out on the first forward, after loading."""
        if self._layer_row is None:
            self._layer_row = self._plan_layer_row() or False
        return self._layer_row or None

    def kernel_name(self) -> str:
        """How the decoder layer runs, for describe()."""
        if self.fused and cpu_kernels.usable() and self.fc.weight.dtype in cpu_kernels.DTYPES and self.layer_row():
            return "one C call a step (cpu_kernels.head_layer)"
        return "module by module"

    def _plan_layer_row(self) -> LayerRow | None:
        dtype, hidden_norm = self.fc.weight.dtype, self.hidden_norm.weight
        row = stack_row([self.embed_norm.weight, self.post_norm.weight],
                        (self.attn.qkv, self.attn.o, self.mlp.gate_up, self.mlp.down), dtype)
        if row is None or len(row.groups) > 1 or hidden_norm.dtype != dtype or hidden_norm.device.type != "cpu":
            return None
        flags = (HEAD_FLAGS["norm_twice"] * self.cfg.hidden_norm_after_input_norm
                 + HEAD_FLAGS["normed_residual"] * self.cfg.norm_before_residual)
        return LayerRow(torch.tensor(row.addresses, dtype=torch.int64), next(iter(row.groups), 0), flags, row.held)

    def new_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        lc, p = self.cfg.layer, self.fc.weight
        return KVCache(1, num_slots, max_seq_len, lc.num_kv_heads, lc.head_dim, p.dtype, p.device)

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, cache: KVCache,
                logits_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds: [B, T, H] target embeddings of x_{t+1}; hidden: [B, T, H] fused target (or the
        head's own) hidden state at t; logits_index: [B, N].
        Returns draft-vocab logits [B, N, Vd] (fp32) and the pre-norm outputs [B, N, H]."""
        dtype = hidden.dtype
        cos = self.rope_cos[fb.positions].to(dtype)[:, :, None, :]
        sin = self.rope_sin[fb.positions].to(dtype)[:, :, None, :]
        c = self.kernels.c(hidden) if self.fused and embeds.dtype == cache.k.dtype == dtype else None
        plan = self.layer_row() if c is not None else None
        if plan is not None:  # the same kernels and bits as the modules below, without their dispatch
            out = c.head_layer(embeds, hidden, plan.row, self.hidden_norm.weight, plan.flags, plan.group_size,
                                     self.cfg.layer, cos, sin, cache, fb)
        else:
            h = self.hidden_norm(self.embed_norm(hidden) if self.cfg.hidden_norm_after_input_norm else hidden)
            x = torch.cat((self.embed_norm(embeds), h), dim=-1)  # [B, T, 2H]
            out = (h if self.cfg.norm_before_residual else hidden) + self.attn(x, cos, sin, cache, fb)
            out = out + self.mlp(self.post_norm(out))
        out = out.gather(1, logits_index[:, :, None].expand(-1, -1, out.shape[-1]))
        return self.lm_head(self.norm(out)).float(), out


class Eagle3Proposer:
    """Chain drafting with an EAGLE-3 head, batched, with per-row catch-up and rollback.

    Per request the head keeps K/V for positions 0..head_len-1, computed from the target's own hidden
    states, plus the target's captured hidden states for head_len..target_len-1 that it hasn't
    consumed yet (a verification's accepted tokens, or every token decoded while the gate kept
    speculation off). Drafting first consumes those (catch-up), ending at the pending token, then
    feeds its own output K-1 more times. Positions drafted from its own hidden states are
    overwritten once the target has verified them: that is the rollback.
    """

    name = "eagle3"

    def __init__(self, head: Eagle3Head, target: Transformer, num_slots: int, max_seq_len: int):
        if head.cfg.target_vocab_size != target.cfg.vocab_size:
            raise DraftMismatchError(
                f"the EAGLE-3 head was trained for a {head.cfg.target_vocab_size}-token vocabulary but the target "
                f"has {target.cfg.vocab_size}; use a head trained for this target (pipeline draft train)")
        if head.cfg.target_hidden_size != target.cfg.hidden_size or max(head.cfg.aux_layer_ids) >= target.cfg.num_layers:
            raise DraftMismatchError(
                f"the EAGLE-3 head reads {head.cfg.target_hidden_size}-wide hidden states of layers "
                f"{list(head.cfg.aux_layer_ids)}, but the target has hidden size {target.cfg.hidden_size} and "
                f"{target.cfg.num_layers} layers; use a head trained for this target (pipeline draft train)")
        self.head, self.target = head, target
        # The target's forward captures hidden states *entering* a layer; the output of layer i enters i+1.
        self.capture_layers = tuple(i + 1 for i in head.cfg.aux_layer_ids)
        self.cache = head.new_cache(num_slots, max_seq_len)
        self.head_len: dict[int, int] = {}  # request id -> positions with head K/V from target features
        self.pending: dict[int, list[torch.Tensor]] = {}  # request id -> captured [n, A] not yet consumed
        self.graphed: GraphedHead | None = None  # set by capture_graphs where the engine's steps replay graphs

    def capture_graphs(self, max_batch: int, max_width: int, replay: bool) -> None:
        """The head's catch-up (up to max_width tokens: a verify's accepted drafts and its bonus) and draft steps
        from CUDA graphs; a longer catch-up (a prompt, or tokens decoded while the gate kept speculation off) runs
        eagerly."""
        self.graphed = GraphedHead(self.head, self.target.embed_tokens, self.cache, max_batch, max_width, replay=replay)
        self.graphed.capture()

    def _head(self, ids: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch,
              last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [b, Vd], pre-norm outputs [b, 1, H]) at each row's position `last`, graphed where a graph
        holds the shape. The graph's outputs are overwritten by its next replay: callers index them (a copy)."""
        graphed = self.graphed(ids, hidden, fb, last) if self.graphed is not None else None
        if graphed is None:
            graphed = self.head(self.target.embed_tokens(ids), hidden, fb, self.cache, last)
        logits, out = graphed
        return logits[:, 0], out

    def on_target_hidden(self, req: Request, aux: torch.Tensor) -> None:
        """aux: [n, A], the target's captured states for the next n positions it has settled.

        Kept until the next proposal for this request (no head work runs while the gate is off), so a
        request that never speculates holds up to max_seq_len x A values until it leaves."""
        self.pending.setdefault(req.id, []).append(aux.clone())  # a row, not the whole batch's tensor

    @torch.inference_mode()  # fc below runs outside the head's forward: with autograd on it left the C kernels
    def propose(self, reqs: list[Request], ks: list[int]) -> Proposal:
        dev = self.head.fc.weight.device
        stochastic = frozenset(i for i, r in enumerate(reqs) if not r.params.greedy)

        # Step 0, catch-up: positions head_len..target_len-1 with the target's states and the
        # tokens that followed them (the last one is the pending token).
        starts = [self.head_len.get(r.id, 0) for r in reqs]
        auxes = [torch.cat(self.pending.pop(r.id)) for r in reqs]
        lengths = [a.shape[0] for a in auxes]
        T = max(lengths)
        feeds = [r.all_ids[s + 1: s + 1 + n] for r, s, n in zip(reqs, starts, lengths)]
        aux = torch.stack([nn.functional.pad(a, (0, 0, 0, T - a.shape[0])) for a in auxes]).to(dev)  # [B, T, A]
        hidden = self.head.fc(aux)  # [B, T, H]
        for r, s, n in zip(reqs, starts, lengths):
            self.head_len[r.id] = s + n
        if not stochastic and all(r.guide is None for r in reqs):
            return Proposal(tokens=self._greedy_drafts(reqs, ks, starts, feeds, hidden))
        # A guided row drafts under its grammar (guide.py): each step masked by the state after its drafts so far.
        guides = GuidedDrafts(reqs)
        try:
            return self._stepwise(reqs, ks, stochastic, guides, starts, feeds, hidden)
        finally:
            guides.pop_all()

    def _stepwise(self, reqs: list[Request], ks: list[int], stochastic: frozenset[int], guides: GuidedDrafts,
                  starts: list[int], feeds: list[list[int]], hidden: torch.Tensor) -> Proposal:
        """Drafts one step at a time through the host: sampled rows (their generators live there) and guided
        rows (their grammars do)."""
        B, K = len(reqs), max(ks)
        dev = self.head.fc.weight.device
        probs = torch.zeros(B, K, self.target.cfg.vocab_size) if stochastic else None
        tokens: list[list[int]] = [[] for _ in reqs]
        to_target = self.head.draft_to_target.cpu()
        rows, T = list(range(B)), max(len(f) for f in feeds)
        for j in range(K):
            ids = torch.tensor([f + [0] * (T - len(f)) for f in (feeds[i] for i in rows)], device=dev)
            fb = ForwardBatch.build([reqs[i].slot for i in rows], [starts[i] for i in rows],
                                    [len(feeds[i]) for i in rows], self.cache, dev)
            last = torch.tensor([len(feeds[i]) - 1 for i in rows], device=dev)[:, None]
            logits, out = self._head(ids, hidden, fb, last)  # [b, Vd], [b, 1, H]
            logits = guides.mask([reqs[i] for i in rows], logits.cpu(), to_target)
            greedy = to_target[logits.argmax(-1)].tolist()
            for n, i in enumerate(rows):
                if i in stochastic:
                    # q over the target vocabulary: zero outside the draft vocabulary.
                    full = torch.full((self.target.cfg.vocab_size,), float("-inf"))
                    full[to_target] = logits[n]
                    q = probs_from_logits(full, reqs[i].params)
                    probs[i, j] = q
                    tokens[i].append(reqs[i].draw(q, reqs[i].num_tokens + j))  # position j past the pending token
                else:
                    tokens[i].append(greedy[n])
                guides.push(reqs[i], tokens[i][-1])
                starts[i] += len(feeds[i])
                feeds[i] = tokens[i][-1:]
            keep = [n for n, i in enumerate(rows) if ks[i] > j + 1]
            if not keep:
                break
            rows = [rows[n] for n in keep]
            hidden = out[keep]  # the head's own pre-norm state feeds the next position
            T = 1
        return Proposal(tokens=tokens, probs=probs, stochastic_rows=stochastic)

    def _greedy_drafts(self, reqs: list[Request], ks: list[int], starts: list[int], feeds: list[list[int]],
                       hidden: torch.Tensor) -> list[list[int]]:
        """Drafts for greedy rows only, as DraftModelProposer._greedy_drafts lays them out: every step's positions
        follow from the lengths, each step feeds the previous one's pick and pre-norm state, which stay on the
        device, and the drafts reach the host in one copy."""
        dev = self.head.fc.weight.device
        plan = draft_plan(reqs, ks, list(starts), feeds, self.cache, dev)
        ids, picks = padded_ids(feeds, dev), []
        for _, fb, last, going_on in plan:
            logits, out = self._head(ids, hidden, fb, last)
            nxt = self.head.draft_to_target[logits.argmax(-1)]  # [b], target ids
            picks.append(nxt)
            ids, hidden = nxt[going_on][:, None], out[going_on]  # copies: the next replay rewrites out
        return drafts_of(plan, torch.cat(picks).tolist(), len(reqs))  # the one wait for the device

    def on_verified(self, req, prev_len, drafted, accepted):
        # Nothing to roll back: head_len already stops at the verified prefix, and the target's states
        # for the pending token and the accepted drafts arrive through on_target_hidden.
        pass

    def release(self, req):
        self.head_len.pop(req.id, None)
        self.pending.pop(req.id, None)


# ---- checkpoints ----------------------------------------------------------------------------

def _detect_layout(cfg: dict, keys: set[str]) -> str:
    if "speculators_model_type" in cfg or "transformer_layer_config" in cfg:
        return "speculators"
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle"
    if any(k.startswith("layers.0.") for k in keys):
        return "modelopt"
    raise ModelFormatError("not an EAGLE-3 head: expected ModelOpt (layers.0.*), EAGLE (midlayer.*) or vLLM "
                           "speculators tensors; export one with `pipeline draft train`")


def read_eagle3_config(cfg: dict, keys: set[str], target_cfg: ModelConfig) -> Eagle3Config:
    """The head's architecture from its config.json, whichever layout wrote it."""
    layout = _detect_layout(cfg, keys)
    layer_dict = dict(cfg.get("transformer_layer_config") or cfg) if layout == "speculators" else dict(cfg)
    family = family_for(str(layer_dict.get("model_type", "llama")))
    if family is None or not family.head_layer:  # a head's layer is a Llama one unless its family says otherwise
        layer_dict["model_type"] = "llama"
    layer_dict["num_hidden_layers"] = 1
    layer_dict.setdefault("vocab_size", target_cfg.vocab_size)
    layer = ModelConfig.from_hf_dict(layer_dict)
    eagle_cfg = cfg.get("eagle_config") or {}
    aux = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or cfg.get("eagle_aux_hidden_state_layer_ids")
    aux_ids = tuple(aux) if aux else default_aux_layer_ids(target_cfg.num_layers)
    return Eagle3Config(
        layer=replace(layer, tie_word_embeddings=False),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or layer_dict.get("draft_vocab_size") or layer.vocab_size),
        target_vocab_size=int(cfg.get("target_vocab_size") or layer.vocab_size),
        target_hidden_size=int(cfg.get("target_hidden_size") or layer.hidden_size),
        aux_layer_ids=aux_ids,
        hidden_norm_after_input_norm=layout == "modelopt",
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        layout=layout,
    )


def to_head_layout(hf: dict[str, torch.Tensor], cfg: Eagle3Config) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> Eagle3Head's names, with q/k/v and gate/up fused."""
    p = "midlayer." if cfg.layout == "eagle" else "layers.0."

    def take(name: str) -> torch.Tensor:
        for key in (name, "model." + name):
            if key in hf:
                return hf[key]
        raise ModelFormatError(f"EAGLE-3 checkpoint ({cfg.layout} layout) is missing tensor {name!r}")

    out = {
        "fc.weight": take("fc.weight"),
        "embed_norm.weight": take(p + "input_layernorm.weight"),
        "hidden_norm.weight": take(p + "hidden_norm.weight"),
        "attn.qkv.weight": torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
        "attn.o.weight": take(p + "self_attn.o_proj.weight"),
        "post_norm.weight": take(p + "post_attention_layernorm.weight"),
        "mlp.gate_up.weight": torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
        "mlp.down.weight": take(p + "mlp.down_proj.weight"),
        "norm.weight": take("norm.weight"),
        "lm_head.weight": take("lm_head.weight"),
    }
    if cfg.layer.qkv_bias:
        out["attn.qkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
    return out


def load_eagle3_head(folder: str | Path, target_cfg: ModelConfig, max_seq_len: int,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Eagle3Head:
    from pipeline.engine.weights import read_safetensors

    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelFormatError(f"{cfg_file} is missing; an EAGLE-3 head folder needs config.json and *.safetensors")
    # The published EAGLE-3 heads ship pytorch_model.bin; weights_only refuses pickled code.
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins and not any(folder.glob("*.safetensors")):
        hf = {}
        for f in bins:
            hf.update(torch.load(f, map_location="cpu", weights_only=True))
    else:
        hf = read_safetensors(folder)
    cfg = read_eagle3_config(json.loads(cfg_file.read_text()), set(hf), target_cfg)
    with torch.device("meta"):
        head = Eagle3Head(cfg, max_seq_len)
    state = {k: v.to(device=device, dtype=dtype) for k, v in to_head_layout(hf, cfg).items()}
    head.load_state_dict(state, strict=False, assign=True)
    d2t = hf.get("d2t")
    if d2t is None and cfg.draft_vocab_size != cfg.target_vocab_size:
        raise ModelFormatError(f"EAGLE-3 head in {folder} has a {cfg.draft_vocab_size}-token draft vocabulary "
                               f"but no d2t table mapping it to the target's")
    offsets = torch.zeros(cfg.draft_vocab_size, dtype=torch.long) if d2t is None else d2t.long()
    head.draft_to_target = (torch.arange(cfg.draft_vocab_size) + offsets).to(device)
    cos, sin = Transformer.rope_tables(cfg.layer, max_seq_len)
    head.rope_cos, head.rope_sin = cos.to(device), sin.to(device)
    missing = [n for n, t in head.named_parameters() if t.is_meta]
    if missing:
        raise ModelFormatError(f"EAGLE-3 checkpoint in {folder} is missing {missing[0]}")
    if int(head.draft_to_target.max()) >= cfg.target_vocab_size:
        raise ModelFormatError(f"EAGLE-3 head in {folder} maps draft tokens past the target vocabulary; its d2t "
                               f"table is for another tokenizer")
    return pack_linears(head.eval())
