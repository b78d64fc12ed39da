"""The scenario and its input: frozen pydantic models loaded from YAML in one place (`scenario`,
`replica`, `base`), the one-line input errors (`errors`), reading the files a user names
(`input_file`, `yaml_input`) and `--set PATH=VALUE` (`overrides`).
"""
