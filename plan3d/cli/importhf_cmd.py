"""`plan3d import-hf config.json -o model.yaml`: a Hugging Face config to a ModelSpec (local file only)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from plan3d.cli.app import app
from plan3d.cost.params import active_params, total_params
from plan3d.errors import SpecError
from plan3d.render.units import count, printable
from plan3d.specs.catalog import require_positive
from plan3d.specs.hf import model_yaml, read_hf
from plan3d.specs.model import ModelSpec


@app.command("import-hf")
def import_hf_cmd(
    config: Annotated[str, typer.Argument(help="Path to a Hugging Face config.json (never fetched from the network).")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the model YAML here (default: print it).")] = None,
    name: Annotated[Optional[str], typer.Option("--name", help="Spec name (default: from the config or its folder).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(
        "--seq-len", help="Training sequence length (default: min(max_position_embeddings, 8192); the config's "
        "maximum context is usually longer than what a model is trained at).")] = None,
) -> None:
    """Convert a Hugging Face config.json (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, OPT, BLOOM...) to a model spec."""
    require_positive("seq_len", seq_len)
    imported = read_hf(config, name=name, seq_len=seq_len)
    spec = imported.spec
    remarks = [f"note: {n}" for n in imported.notes] + [f"warning: {w}" for w in imported.warnings]
    for remark in remarks:  # stderr, so the YAML on stdout stays a clean file
        print(printable(remark), file=sys.stderr)
    text = model_yaml(spec, Path(config).name, remarks)
    if output is None:
        print(text, end="")
        print(f"model {spec.name!r}: {parameter_summary(spec)}", file=sys.stderr)
        return
    try:
        output.write_text(text)
    except OSError as err:
        raise SpecError(str(output), [f"cannot be written ({err.strerror}); choose another -o path"]) from err
    print(f"wrote {printable(str(output))}: model {spec.name!r}, {parameter_summary(spec)}, "
          f"{spec.layers} layers, hidden {spec.hidden}")


def parameter_summary(spec: ModelSpec) -> str:
    """'8.03B parameters'; a mixture-of-experts model also says how many one token passes through."""
    total = f"{count(total_params(spec))} parameters"
    return f"{total} ({count(active_params(spec))} active per token)" if spec.moe is not None else total
