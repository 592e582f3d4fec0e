"""`plan3d import-hf config.json -o model.yaml`: a Hugging Face config to a ModelSpec (local file only)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from plan3d.cli.app import app
from plan3d.errors import SpecError
from plan3d.specs.catalog import require_positive


@app.command("import-hf")
def import_hf_cmd(
    config: Annotated[str, typer.Argument(help="Path to a Hugging Face config.json (never fetched from the network).")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the model YAML here (default: print it).")] = None,
    name: Annotated[Optional[str], typer.Option("--name", help="Spec name (default: from the config or its folder).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Sequence length, when the config has none.")] = None,
) -> None:
    """Convert a Hugging Face config.json (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, OPT, BLOOM...) to a model spec."""
    from plan3d.cost.params import total_params
    from plan3d.render.units import count
    from plan3d.specs.hf import import_hf, model_yaml

    require_positive("seq_len", seq_len)
    spec = import_hf(config, name=name, seq_len=seq_len)
    text = model_yaml(spec, Path(config).name)
    if output is None:
        print(text, end="")
        return
    try:
        output.write_text(text)
    except OSError as err:
        raise SpecError(str(output), [f"cannot be written ({err.strerror}); choose another -o path"]) from err
    print(f"wrote {output}: model {spec.name!r}, {count(total_params(spec))} parameters, "
          f"{spec.layers} layers, hidden {spec.hidden}")
