"""Models embedded in the package, trained by `tools/train_demo_model.py`.

`demo-model` (~4M parameters) is the default model of `LLM()` and the CLI;
`demo-model-tiny` (~1M) shares its tokenizer, for use as a draft model. Both are
Hugging Face model directories: transformers loads them too.
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))

EMBEDDED_MODELS = {
    "demo-model": os.path.join(_HERE, "demo-model"),
    "demo-model-tiny": os.path.join(_HERE, "demo-model-tiny"),
}
DEFAULT_MODEL = "demo-model"
