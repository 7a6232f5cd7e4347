raise ImportError("placeholder")
