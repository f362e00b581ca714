"""Small widgets the screens are made of."""
