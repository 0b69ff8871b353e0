"""The data contract: Arrow schemas of the canonical dataset, params.yaml loading and
validation. Every other stage may use it."""
