//! Numbers as printf writes them (`%g`, `%e`, `%f`, `%`), which is how the explanation has always
//! printed them: `1e-05`, `3.287210e+00`, `0.499 %`, `nan`. Rust's own `{:e}` writes `1e-5` and
//! has no `%g`.

/// `nan`, `inf` or `-inf` for a value that is not finite.
fn non_finite(x: f64) -> Option<String> {
    if x.is_nan() {
        Some("nan".into())
    } else if x.is_infinite() {
        Some(if x > 0.0 { "inf" } else { "-inf" }.into())
    } else {
        None
    }
}

/// The exponent of `{:e}` output as printf writes it: a sign and at least two digits.
fn printf_exponent(rust: &str) -> String {
    match rust.split_once('e') {
        Some((mantissa, exponent)) => {
            let (sign, digits) = match exponent.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exponent),
            };
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => rust.to_string(),
    }
}

/// `%.{digits}e`: `3.287210e+00`.
pub(super) fn exp(x: f64, digits: usize) -> String {
    non_finite(x).unwrap_or_else(|| printf_exponent(&format!("{x:.digits$e}")))
}

/// `%.{digits}f`.
pub(super) fn fixed(x: f64, digits: usize) -> String {
    non_finite(x).unwrap_or_else(|| format!("{x:.digits$}"))
}

/// `%+.{digits}f%` of x·100: a share as a signed percentage, `+0.996%`.
pub(super) fn signed_percent(x: f64, digits: usize) -> String {
    match non_finite(x * 100.0) {
        Some(s) if x.is_nan() => format!("{s}%"),
        Some(s) => format!("{}{s}%", if x > 0.0 { "+" } else { "" }),
        None => format!("{:+.digits$}%", x * 100.0),
    }
}

/// `%.{digits}g`: `digits` significant digits, fixed-point where the exponent is from −4 to
/// digits − 1, else with an exponent; trailing zeros dropped.
pub(super) fn general(x: f64, digits: usize) -> String {
    if let Some(s) = non_finite(x) {
        return s;
    }
    let p = digits.max(1);
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.into();
    }
    // The exponent after rounding to p digits, as %e gives it.
    let e_form = format!("{x:.prec$e}", prec = p - 1);
    let exponent: i32 = e_form
        .split_once('e')
        .and_then(|(_, e)| e.parse().ok())
        .unwrap_or(0);
    let trim = |s: &str| -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    if exponent < -4 || exponent >= p as i32 {
        let (mantissa, e) = e_form.split_once('e').unwrap_or((&e_form, "0"));
        printf_exponent(&format!("{}e{e}", trim(mantissa)))
    } else {
        let decimals = (p as i32 - 1 - exponent).max(0) as usize;
        trim(&format!("{x:.decimals$}"))
    }
}

/// The shortest text that reads back as x, as a number with a point (`4.0`, `0.25`) or, far
/// from 1, with an exponent (`1e-05`, `2.5e+16`).
pub(super) fn shortest(x: f64) -> String {
    if let Some(s) = non_finite(x) {
        return s;
    }
    let a = x.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        printf_exponent(&format!("{x:e}"))
    } else {
        let s = format!("{x}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    }
}

/// `{pct:.3g} %` of x·100: a relative figure as a percentage.
pub(super) fn percent(x: f64) -> String {
    format!("{} %", general(100.0 * x, 3))
}

/// Three significant digits, or `n/a` for an undefined figure.
pub(super) fn sci3(x: f64) -> String {
    if x.is_finite() {
        general(x, 3)
    } else {
        "n/a".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected texts as printf writes them (C's `printf("%.6g", x)` and so on).
    #[test]
    fn numbers_read_as_printf_writes_them() {
        let cases: [(String, &str); 22] = [
            (general(3.287_21, 6), "3.28721"),
            (general(3.303_7, 6), "3.3037"),
            (general(1e-5, 2), "1e-05"),
            (general(1.0e-5, 6), "1e-05"),
            (general(0.000_123_4, 3), "0.000123"),
            (general(2.5, 6), "2.5"),
            (general(1.0, 6), "1"),
            (general(123_456_789.0, 6), "1.23457e+08"),
            (general(999_999.5, 6), "1e+06"),
            (general(0.0165, 3), "0.0165"),
            (general(490.2, 3), "490"),
            (general(2010.0, 3), "2.01e+03"),
            (general(f64::NAN, 3), "nan"),
            (exp(3.287_21, 6), "3.287210e+00"),
            (exp(0.004_99, 2), "4.99e-03"),
            (exp(1.5e123, 1), "1.5e+123"),
            (fixed(f64::INFINITY, 4), "inf"),
            (signed_percent(0.009_96, 3), "+0.996%"),
            (signed_percent(-0.029_4, 2), "-2.94%"),
            (shortest(4.0), "4.0"),
            (shortest(1e-5), "1e-05"),
            (percent(0.004_99), "0.499 %"),
        ];
        for (got, want) in cases {
            assert_eq!(got, want);
        }
        assert_eq!(sci3(f64::INFINITY), "n/a");
        assert_eq!(shortest(0.25), "0.25");
    }
}
