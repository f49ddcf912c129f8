{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tandem.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.redisUrl" -}}
{{- if and .Values.redis.enabled .Values.redis.cluster -}}{{ fail "redis.cluster needs redis.externalUrl (a node of your Redis Cluster) and redis.enabled=false" }}{{- end -}}
{{- if .Values.redis.enabled -}}redis://{{ include "tandem.fullname" . }}-redis:6379/0{{- else -}}{{ required "redis.externalUrl is required when redis.enabled=false" .Values.redis.externalUrl }}{{- end -}}
{{- end -}}

{{- define "tandem.secretName" -}}{{ include "tandem.fullname" . }}-secrets{{- end -}}


{{- define "tandem.tokenSecretRef" -}}
{secretKeyRef: {name: {{ .Values.internalTokenSecret.name | default (include "tandem.secretName" .) }}, key: {{ .Values.internalTokenSecret.key | default "internal-token" }}}}
{{- end -}}
