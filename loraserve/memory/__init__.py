"""Memory below the engine and the adapters: the pages of the one pool both draw on."""
