"""The files of a PEFT adapter directory, named apart from their readers: the CLI's upload and the registry's
archive and file store need the names, not torch."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")  # refused, never unpickled
