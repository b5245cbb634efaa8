"""The frontend tests never download: every Hugging Face model is built from a config."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
