"""The torch-native reference: the semantics every backend matches, and the fallback on every device."""
