"""The shipped assets, installed as the package `medusa_chat.assets` (see pyproject.toml and
`medusa_chat.registry.assets_dir`): the embedded model's Medusa heads and tree in `smollm2-135m/`."""
