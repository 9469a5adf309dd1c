// Keeps the folder library non-empty while the folder has no sources of its own.
