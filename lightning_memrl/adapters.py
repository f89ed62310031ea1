"""LoRA adapters (peft): their options, named as peft names them, and how the policy is wrapped.

The LoRA policy's reference model (the KL term's, and the model of a workflow's frozen agents) is
the same network with its adapters disabled: the pretrained base. Options that would make the
disabled network differ from that base are refused (see :class:`LoraSettings`).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lightning_memrl.errors import ConfigError, check_option

log = logging.getLogger(__name__)

P = "model.init_args.lora."
KEEPS_BASE_INITS = (True, False, "gaussian", "orthogonal", "mica")  # init_lora_weights that leave the base as is
ALIASES = {"alpha": ("lora_alpha", 32), "dropout": ("lora_dropout", 0.0)}  # our former name -> peft's, default


@dataclass
class LoraSettings:
    """LoRA adapters (peft's ``LoraConfig``; every name but the ``*_adapter_name_or_path`` ones is peft's).

    With LoRA the reference model is the base with adapters disabled, or the saved adapter
    ``reference_adapter_name_or_path``.

    Args:
        r: adapter rank.
        lora_alpha: scaling numerator: the adapter output is multiplied by ``lora_alpha / r``
            (``lora_alpha / sqrt(r)`` with ``use_rslora``). None: 32 (or ``alpha``).
        lora_dropout: dropout on the adapter input (``grpo.disable_dropout`` sets it to 0 by
            default). None: 0.0 (or ``dropout``).
        target_modules: module names to adapt; ``all-linear`` adapts every linear layer but the output head.
        bias: ``none``, ``all`` or ``lora_only``: which biases train. Not ``none`` trains biases of
            the base itself, which disabling the adapters does not undo, so it is refused when a
            reference is needed (``grpo.kl_coef > 0`` or a workflow with frozen agents).
        use_rslora: rank-stabilised LoRA: scale by ``lora_alpha / sqrt(r)`` instead of ``lora_alpha / r``.
        use_dora: weight-decomposed LoRA (DoRA): a trained magnitude per output feature.
        modules_to_save: further modules trained in full (a trainable copy each, e.g. ``[lm_head]``);
            the reference keeps the originals.
        init_lora_weights: ``true`` (B = 0: the adapted model starts as the base), ``false``
            (random A and B: it does not), ``gaussian``, ``orthogonal`` (even ``r``) or ``mica``.
            PiSSA, OLoRA, CorDA and LoftQ are refused (they rewrite the base weights, which are the
            reference), and so are EVA and LoRA-GA (they need a data pass before training).
        layers_to_transform: indices of the decoder layers to adapt (an int: one layer); None: all.
            With ``target_modules: all-linear`` the linear layers' names are listed for peft.
        adapter_name_or_path: a saved peft LoRA adapter (a folder from ``save_pretrained``, or a hub
            id) to train further instead of new adapters; its ``adapter_config.json`` then sets the
            adapter's shape and the options above (but ``lora_dropout``) are not used.
        frozen_adapter_name_or_path: a saved peft LoRA adapter that a workflow's frozen agents generate
            with (loaded next to the trained adapter, never trained, e.g. the trained memory manager
            while Memory-R1's answer agent trains); None: they use the base with adapters disabled.
        reference_adapter_name_or_path: a saved peft LoRA adapter whose model is the KL term's reference
            (loaded next to the trained adapter, never trained), e.g. the SFT adapter that
            ``adapter_name_or_path`` continues from, so that ``grpo.kl_coef`` keeps the policy near the warm
            start rather than pulling it back to the base. None: the base with adapters disabled. Not
            loaded (a warning says so) when ``grpo.kl_coef`` is 0.
        alpha: former name of ``lora_alpha`` (give one of the two).
        dropout: former name of ``lora_dropout`` (give one of the two).
    """

    r: int = 16
    lora_alpha: int | float | None = None
    lora_dropout: float | None = None
    target_modules: list[str] | str = field(default_factory=lambda: "all-linear")
    bias: Literal["none", "all", "lora_only"] = "none"
    use_rslora: bool = False
    use_dora: bool = False
    modules_to_save: list[str] | None = None
    init_lora_weights: bool | str = True
    layers_to_transform: list[int] | int | None = None
    adapter_name_or_path: str | None = None
    frozen_adapter_name_or_path: str | None = None
    reference_adapter_name_or_path: str | None = None
    alpha: int | float | None = None
    dropout: float | None = None

    def __post_init__(self) -> None:
        for old, (new, default) in ALIASES.items():
            given_old, given_new = getattr(self, old), getattr(self, new)
            if given_old is not None and given_new is not None:
                raise ConfigError(
                    f"{P}{old} is the former name of {P}{new} (peft's): give only {new} "
                    f"(got {old}={given_old!r} and {new}={given_new!r})"
                )
            value = given_new if given_new is not None else given_old
            setattr(self, new, default if value is None else value)
            setattr(self, old, None)  # one name from here on: the settings rebuild from their fields alike
        check_option(P + "r", self.r, 1)
        check_option(P + "lora_alpha", self.lora_alpha, 0.0, low_open=True)
        check_option(P + "lora_dropout", self.lora_dropout, 0.0, 1.0, high_open=True)
        if self.bias not in ("none", "all", "lora_only"):
            raise ConfigError(f"{P}bias must be one of none, all, lora_only (got {self.bias!r})")
        self._check_init()
        if self.layers_to_transform is not None and isinstance(self.target_modules, str):
            if self.target_modules != "all-linear":
                raise ConfigError(
                    f"{P}layers_to_transform needs {P}target_modules as a list of module names (or all-linear), "
                    f"not the pattern {self.target_modules!r}: peft cannot restrict a pattern to layers"
                )

    def _check_init(self) -> None:
        init = self.init_lora_weights
        if any(init is ok or (isinstance(init, str) and init == ok) for ok in KEEPS_BASE_INITS):
            return
        if isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda", "loftq")):
            why = (
                "it rewrites the base weights, and the base with adapters disabled is the reference model "
                "(KL term, frozen agents): it would no longer be the pretrained model"
            )
        elif isinstance(init, str) and init.lower() in ("eva", "lora_ga"):
            why = "it needs a data-driven initialisation pass before training, which training does not run"
        else:
            why = "it is not one of peft's initialisations"
        raise ConfigError(
            f"{P}init_lora_weights={init!r} is not supported: {why}. Use one of true, false, gaussian, orthogonal, mica"
        )

    def resolved(self, name: str) -> Any:
        """``lora_alpha`` or ``lora_dropout``, also of settings saved before they had these names."""
        old = next(o for o, (n, _) in ALIASES.items() if n == name)
        value = getattr(self, name, None)
        value = value if value is not None else getattr(self, old, None)
        return value if value is not None else ALIASES[old][1]

    def to_peft_config(self, model: Any) -> Any:
        """The matching ``peft.LoraConfig`` for ``model`` (whose linear layers ``all-linear`` lists
        when ``layers_to_transform`` is set)."""
        from peft import LoraConfig

        targets = self.target_modules
        if self.layers_to_transform is not None and targets == "all-linear":
            targets = linear_layer_names(model)
        return LoraConfig(
            r=self.r,
            lora_alpha=self.resolved("lora_alpha"),
            lora_dropout=self.resolved("lora_dropout"),
            target_modules=targets,
            bias=getattr(self, "bias", "none"),
            use_rslora=getattr(self, "use_rslora", False),
            use_dora=getattr(self, "use_dora", False),
            modules_to_save=getattr(self, "modules_to_save", None),
            init_lora_weights=getattr(self, "init_lora_weights", True),
            layers_to_transform=getattr(self, "layers_to_transform", None),
            task_type="CAUSAL_LM",
        )


def linear_layer_names(model: Any) -> list[str]:
    """Names (last part) of ``model``'s linear layers but its output head: what ``all-linear`` adapts."""
    head = model.get_output_embeddings()
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head
        }
    )


def adapter_config(path: str, option: str = "adapter_name_or_path") -> Any:
    """The ``LoraConfig`` of the saved adapter at ``path``, or one clear error naming the ``option``."""
    from peft import PeftConfig

    try:
        config = PeftConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"{P}{option}={path!r}: no peft adapter found ({err}). Pass a folder that peft's "
            "save_pretrained wrote (adapter_config.json and adapter_model.safetensors) or the hub id of one"
        ) from err
    if str(config.peft_type) not in ("LORA", "PeftType.LORA"):
        raise ConfigError(f"{P}{option}={path!r} is a {config.peft_type} adapter; only LoRA is supported")
    return config


def add_lora(model: Any, lora: LoraSettings, empty_weights: bool = False) -> Any:
    """``model`` wrapped by peft: new LoRA adapters, or the saved ones of ``lora.adapter_name_or_path``,
    trainable. With ``empty_weights`` they are built on meta (the sharded loader fills them from rank 0)."""
    from peft import PeftModel, get_peft_model

    path = getattr(lora, "adapter_name_or_path", None)
    if path is None:
        config = lora.to_peft_config(model)
    else:
        config = adapter_config(path)
        config.lora_dropout = lora.resolved("lora_dropout")
        log.info(
            "LoRA: training the adapter at %s further (r=%s, lora_alpha=%s, target_modules=%s, use_rslora=%s, "
            "use_dora=%s); its adapter_config.json sets the adapter, not the lora options",
            path,
            config.r,
            config.lora_alpha,
            config.target_modules,
            config.use_rslora,
            config.use_dora,
        )
        if not empty_weights:
            return PeftModel.from_pretrained(model, path, config=config, is_trainable=True)
    with torch.device("meta") if empty_weights else nullcontext():
        return get_peft_model(model, config)


def check_base_reference(policy: Any, uses: str) -> None:
    """Refuse adapters whose disabling does not give back the base (trained biases), when ``uses`` needs it.

    Args:
        policy: the peft-wrapped policy.
        uses: what needs the base, for the message (e.g. ``grpo.kl_coef > 0``).
    """
    bias = policy.peft_config[policy.active_adapter].bias
    if bias != "none":
        raise ConfigError(
            f"{P}bias={bias!r} trains the base model's biases, which disabling the adapters does not undo; "
            f"{uses} needs the base with adapters disabled to stay the pretrained model: set {P}bias: none"
        )
