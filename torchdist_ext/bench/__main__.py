"""``python -m torchdist_ext.bench``: see the package docstring."""
from torchdist_ext.bench import main

if __name__ == "__main__":
    main()
